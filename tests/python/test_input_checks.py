"""Inputs the module refuses with a message that says what was given and what is accepted (issue 28, item 8):
a recurrent update whose all_states disagree with the final state or with the layer's conv part, prompts and
token lists of the wrong type, misaligned float32 arrays."""

import os

import numpy as np
import pytest
import torch

import rewind
from conftest import REPO, conv_in

TARGET = os.path.join(REPO, "models", "kjv-hybrid")


@pytest.fixture(scope="module")
def target():
    return rewind.Model.load(TARGET)


def linear_layer_after_conv(q):
    """A linear-attention layer (kernel 2, recording 4) whose conv part has received q tokens and whose recurrent
    part has received none."""
    layer = rewind.LinearAttentionLayer(conv_kernel_size=2)
    layer.activate_past_recording(4)
    layer.update_conv_state(conv_in(0, q))
    return layer


def states(q, start=0):
    """q recurrent states [q, 1, 2, 2], state t holding start + t + 1 everywhere."""
    return torch.stack([torch.full((1, 2, 2), float(start + t + 1)) for t in range(q)])


# ---- update_recurrent_state(final, all_states=s) -----------------------------------------

def test_all_states_whose_last_differs_from_final_is_refused_and_nothing_is_stored():
    layer = linear_layer_after_conv(3)
    s = states(3)
    with pytest.raises(ValueError, match=r"differs from all_states\[-1\]") as e:
        layer.update_recurrent_state(torch.full((1, 2, 2), 99.0), all_states=s)
    assert isinstance(e.value, rewind.InvalidArgument)
    # Nothing stored: no recurrent part was even created, and the conv part is where it was.
    assert layer.is_recurrent_states_initialized[0] is False
    assert layer.recurrent_states[0] is None
    assert layer.conv_states[0] is not None and layer.get_seq_length() == 3
    # The same call with the matching final state is stored, each state crop-exact.
    got = layer.update_recurrent_state(s[-1], all_states=s)
    assert torch.equal(got, s[-1])
    layer.crop(-1)
    assert torch.equal(layer.recurrent_states[0], s[1])


def test_final_of_another_shape_is_refused():
    layer = linear_layer_after_conv(2)
    with pytest.raises(rewind.InvalidArgument, match=r"shape \(1, 2, 3\) against all_states\[-1\]'s \(1, 2, 2\)"):
        layer.update_recurrent_state(torch.ones(1, 2, 3), all_states=states(2))
    assert layer.is_recurrent_states_initialized[0] is False


def test_nan_states_compare_equal_to_themselves():
    layer = linear_layer_after_conv(2)
    s = states(2)
    s[1, 0, 0, 0] = float("nan")
    got = layer.update_recurrent_state(s[1].clone(), all_states=s)
    assert torch.isnan(got[0, 0, 0]) and got[0, 1, 1] == 2.0


@pytest.mark.parametrize("q", [2, 4])
def test_all_states_of_another_length_than_the_conv_step_is_refused(q):
    layer = linear_layer_after_conv(3)
    s = states(q)
    with pytest.raises(rewind.InvalidArgument,
                       match=f"all_states holds {q} states but this layer's conv part received 3 token"):
        layer.update_recurrent_state(s[-1], all_states=s)
    assert layer.is_recurrent_states_initialized[0] is False
    # A later step: conv 3 -> 4 (one token), recurrent at 3; two states are refused, one is stored.
    layer.update_recurrent_state(states(3)[-1], all_states=states(3))
    layer.update_conv_state(conv_in(3, 1))
    before = layer.recurrent_states[0].clone()
    with pytest.raises(rewind.InvalidArgument, match="holds 2 states but this layer's conv part received 1 token"):
        layer.update_recurrent_state(states(2, 3)[-1], all_states=states(2, 3))
    assert torch.equal(layer.recurrent_states[0], before)
    one = states(1, 3)
    assert torch.equal(layer.update_recurrent_state(one[-1], all_states=one), one[-1])
    # Every state stored is one of an accepted call: back one token is S(3), back four S(0).
    assert layer.get_seq_length() == 4 and layer.max_rollback() == 4
    layer.crop(-1)
    assert torch.equal(layer.recurrent_states[0], before)
    layer.crop(-3)
    assert layer.get_seq_length() == 0 and torch.equal(layer.recurrent_states[0], torch.zeros(1, 2, 2))


def test_the_cache_wrapper_refuses_as_the_layer_does():
    c = rewind.DynamicCache(layer_types=["linear_attention"], conv_kernel_size=2)
    c.update_conv_state(conv_in(0, 3), 0)
    with pytest.raises(rewind.InvalidArgument, match="conv part received 3"):
        c.update_recurrent_state(states(5)[-1], 0, all_states=states(5))
    with pytest.raises(rewind.InvalidArgument, match="differs from all_states"):
        c.update_recurrent_state(torch.zeros(1, 2, 2), 0, all_states=states(3))
    c.update_recurrent_state(states(3)[-1], 0, all_states=states(3))
    assert c.get_seq_length() == 3


# ---- token ids of the wrong type -----------------------------------------------------------

@pytest.mark.parametrize("prompt, given", [
    (b"abc", "got bytes"),
    (bytearray(b"abc"), "got bytearray"),
    ([1.5], "element 0 is float 1.5"),
    ([256, 3, "x"], "element 2 is str 'x'"),
    (np.array([1.0, 2.0]), "ndarray of dtype float64"),
    (torch.tensor([1.0]), "Tensor of dtype torch.float32"),
    (np.array([[1, 2]]), "2 dimensions"),
    (7, "got int"),
])
def test_generate_refuses_a_prompt_of_the_wrong_type_with_a_type_error(target, prompt, given):
    with pytest.raises(TypeError) as e:
        target.generate(prompt, max_new_tokens=2)
    message = str(e.value)
    assert "Unable to cast" not in message
    assert message.startswith("generate: the prompt must be a str (text) or a list of ints (token ids)"), message
    assert given in message, message


@pytest.mark.parametrize("tokens, given", [([1.5], "element 0 is float 1.5"), (b"abc", "got bytes"),
                                           ("abc", "got str")])
def test_forward_refuses_tokens_of_the_wrong_type_and_leaves_the_cache_empty(target, tokens, given):
    cache = target.make_cache()
    with pytest.raises(TypeError) as e:
        target.forward(tokens, cache)
    message = str(e.value)
    assert message.startswith("forward: tokens must be a list of ints (token ids)"), message
    assert given in message and "Unable to cast" not in message, message
    assert cache.get_seq_length() == 0


def test_integer_token_containers_are_accepted(target):
    want, _ = target.generate([256, 73, 110], max_new_tokens=4)
    for same in ((256, 73, 110), np.array([256, 73, 110], dtype=np.int32), torch.tensor([256, 73, 110]),
                 [np.int64(256), np.int32(73), 110]):
        got, _ = target.generate(same, max_new_tokens=4)
        assert got == want, type(same)
    with pytest.raises(TypeError, match="generate_batch: prompt 1 must be .*; got list whose element 0 is float"):
        target.generate_batch([[256, 73], [2.5]], max_new_tokens=2)
    with pytest.raises(rewind.InvalidArgument, match="outside"):
        target.generate([-1], max_new_tokens=2)
    with pytest.raises(TypeError, match=r"generate_batch: prompts must be a list of prompts .*got a str"):
        target.generate_batch("In the beginning", max_new_tokens=2)


# ---- misaligned float32 arrays ----------------------------------------------------------------

def misaligned_float32(shape):
    """A float32 array whose data starts one byte past an aligned address (numpy reports its format as '=f')."""
    n = int(np.prod(shape))
    raw = np.zeros(n * 4 + 1, dtype=np.uint8)
    a = np.frombuffer(raw.data, dtype=np.float32, count=n, offset=1).reshape(shape)
    assert not a.flags.aligned
    return a


def test_a_misaligned_float32_array_is_refused_as_misaligned_and_an_aligned_copy_works():
    k = misaligned_float32((1, 2, 3, 4))
    layer = rewind.DynamicLayer()
    with pytest.raises(rewind.InvalidArgument) as e:
        layer.update(k, k)
    message = str(e.value)
    assert "misaligned" in message and hex(k.ctypes.data) in message, message
    assert "an aligned copy is accepted: a.copy()" in message, message
    assert "not supported" not in message, message
    assert layer.get_seq_length() == 0
    assert not np.ascontiguousarray(k).flags.aligned  # why the message names a.copy()
    aligned = k.copy()
    assert aligned.flags.aligned
    keys, _ = layer.update(aligned, aligned.copy())
    assert layer.get_seq_length() == 3 and np.array_equal(keys, aligned)


def test_a_big_endian_array_is_refused_for_its_byte_order():
    k = np.zeros((1, 2, 3, 4), dtype=">f4")
    with pytest.raises(rewind.InvalidArgument, match="byte order"):
        rewind.DynamicLayer().update(k, k)
