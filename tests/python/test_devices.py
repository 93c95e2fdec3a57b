"""Devices: where a cache's state lives (device= or the first update), zero-copy results on that device, and the
refusals (a device rewind cannot use, a tensor on another device than the cache's), which change nothing."""

import copy
import os
import pickle

import pytest
import torch

import rewind
from conftest import STORAGE, kv, positions


def _module_build_has_cuda():
    """Whether the build the imported module came from compiled the CUDA backend (its build files say so), or None
    when the module does not sit in a build tree."""
    build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(rewind.__file__))))
    # Ninja keeps every compile line in build.ninja; Makefiles keep the library's in its flags.make.
    files = [os.path.join(build, "build.ninja"), os.path.join(build, "CMakeFiles", "rewind.dir", "flags.make")]
    present = [f for f in files if os.path.exists(f)]
    if not present:
        return None
    with open(present[0], encoding="utf-8", errors="replace") as f:
        return "-DREWIND_WITH_CUDA" in f.read()


CUDA_HERE = torch.cuda.is_available() and rewind.cuda_built() and rewind.cuda_device_count() > 0


def test_cuda_built_matches_the_build():
    has = _module_build_has_cuda()
    if has is None:
        pytest.skip("the module is not in a CMake build tree")
    assert rewind.cuda_built() is has
    if not rewind.cuda_built():
        assert rewind.cuda_device_count() == 0


@pytest.mark.zero_copy
def test_cpu_device_gives_views_of_the_cache():
    cache = rewind.DynamicCache(device="cpu")
    assert cache.device == torch.device("cpu")
    keys, values = cache.update(kv(0, 3), kv(0, 3), 0)
    assert keys.device == torch.device("cpu") and values.device == torch.device("cpu")
    assert cache.layers[0].device == torch.device("cpu")
    keys[0, 0, 1, 0] = 99.0  # an in-place write into the returned view is the cache's storage
    again, _ = cache.update(kv(3, 1), kv(3, 1), 0)
    assert positions(again) == [0, 99, 2, 3]
    assert rewind._rewind.input_data_ptr(again) == rewind._rewind.input_data_ptr(cache.layers[0].keys)


def test_device_taken_from_the_first_update(device):
    cache = rewind.DynamicCache()
    assert cache.device is None
    keys, values = cache.update(kv(0, 2, device=device), kv(0, 2, device=device), 0)
    assert cache.device.type == device and keys.device.type == device and values.device.type == device
    # A second layer, created later, goes on the same device.
    k1, _ = cache.update(kv(0, 2, device=device), kv(0, 2, device=device), 1)
    assert k1.device.type == device
    cache.crop(-1)
    assert cache.get_seq_length() == 1 and positions(cache.layers[0].keys.cpu()) == [0]


def test_device_argument_is_used(device):
    cache = rewind.DynamicCache(device=device)
    assert cache.device.type == device
    keys, _ = cache.update(kv(0, 2, device=device), kv(0, 2, device=device), 0)
    assert keys.device.type == device and positions(keys.cpu()) == [0, 1]
    layer = rewind.DynamicLayer(device=torch.device(device))
    assert layer.device.type == device
    out, _ = layer.update(kv(0, 1, device=device), kv(0, 1, device=device))
    assert out.device.type == device


def test_meta_tensor_refused_and_nothing_created():
    cache = rewind.DynamicCache()
    meta = torch.empty(1, 2, 1, 4, device="meta")
    with pytest.raises(ValueError, match=r"meta.*allowed: cpu") as err:
        cache.update(meta, meta, 0)
    assert isinstance(err.value, rewind.InvalidArgument)
    assert len(cache.layers) == 0 and cache.device is None
    keys, _ = cache.update(kv(0, 1), kv(0, 1), 0)  # still usable, on the first real device
    assert keys.device == torch.device("cpu")


def test_meta_tensor_refused_by_a_cache_with_state():
    cache = rewind.DynamicCache(device="cpu")
    cache.update(kv(0, 3), kv(0, 3), 0)
    before = cache.layers[0].keys.clone()
    meta = torch.empty(1, 2, 1, 4, device="meta")
    with pytest.raises(rewind.InvalidArgument, match=r"meta.*allowed: cpu"):
        cache.update(meta, meta, 0)
    assert cache.get_seq_length() == 3 and torch.equal(cache.layers[0].keys, before)


@pytest.mark.parametrize("spec", ["meta", "mps", "xla", "not a device", 3.5])
def test_unusable_device_argument_refused(spec):
    with pytest.raises(rewind.InvalidArgument, match=r"allowed: cpu"):
        rewind.DynamicCache(device=spec)
    with pytest.raises(rewind.InvalidArgument, match=r"allowed: cpu"):
        rewind.DynamicLayer(device=spec)


@pytest.mark.skipif(CUDA_HERE, reason="CUDA is usable here")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_refused_without_a_device(spec):
    pins = rewind.pin_stats()
    expected = "no CUDA backend" if not rewind.cuda_built() else "no device"
    with pytest.raises(ValueError, match=expected) as err:
        rewind.DynamicCache(device=spec)
    assert "cuda" in str(err.value) and "allowed: cpu" in str(err.value)
    with pytest.raises(rewind.InvalidArgument, match=expected):
        rewind.DynamicCache(device=torch.device(spec))
    with pytest.raises(rewind.InvalidArgument, match=expected):
        rewind.DynamicCache(config={"layer_types": ["full_attention"]}, device=spec)
    with pytest.raises(rewind.InvalidArgument, match=expected):
        rewind._rewind._Layer("full_attention", num_kv_heads=1, key_dim=2, value_dim=2, device=spec)
    assert rewind.pin_stats() == pins


def test_early_initialization_device():
    cache = rewind.DynamicCache(config={"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4})
    cache.early_initialization(1, 2, 4, torch.float32, "cpu")
    assert cache.device == torch.device("cpu")
    assert all(layer.device == torch.device("cpu") for layer in cache.layers)
    keys, _ = cache.update(kv(0, 1), kv(0, 1), 0)
    assert positions(keys) == [0]
    with pytest.raises(rewind.InvalidArgument, match="allowed: cpu"):
        rewind.DynamicCache(config={"layer_types": ["full_attention"]}).early_initialization(
            1, 2, 4, torch.float32, "meta")


def test_numpy_cache_is_on_cpu():
    np = pytest.importorskip("numpy")
    cache = rewind.DynamicCache()
    a = np.zeros((1, 1, 2, 2), dtype=np.float32)
    keys, _ = cache.update(a, a, 0)
    assert isinstance(keys, np.ndarray) and cache.device == torch.device("cpu")


def test_copies_keep_the_device(device):
    cache = rewind.DynamicCache(device=device)
    cache.update(kv(0, 2, device=device), kv(0, 2, device=device), 0)
    for other in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert other.device.type == device
        keys, _ = other.update(kv(2, 1, device=device), kv(2, 1, device=device), 0)
        assert keys.device.type == device and positions(keys.cpu()) == [0, 1, 2]


def test_layers_on_two_devices_do_not_share_a_cache():
    layer = rewind.DynamicLayer(device="cpu")
    # Only cpu is usable here; a layer fixed on it joins a cpu cache, and the cache takes its device.
    cache = rewind.Cache(layers=[layer])
    assert cache.device == torch.device("cpu")
    if not CUDA_HERE:
        return
    with pytest.raises(rewind.InvalidArgument, match=r"cpu.*cuda|cuda.*cpu"):
        rewind.Cache(layers=[rewind.DynamicLayer(device="cpu")], device="cuda")


@pytest.mark.skipif(not CUDA_HERE, reason="needs a CUDA device (torch, rewind's build and the machine)")
def test_mismatched_update_refused_and_cache_unchanged():
    for cache_device, other in (("cpu", "cuda"), ("cuda", "cpu")):
        cache = rewind.DynamicCache(device=cache_device)
        cache.update(kv(0, 2, device=cache_device), kv(0, 2, device=cache_device), 0)
        before = cache.layers[0].keys.cpu().clone()
        with pytest.raises(rewind.InvalidArgument, match="is on .*but this cache is on") as err:
            cache.update(kv(2, 1, device=other), kv(2, 1, device=other), 0)
        assert cache_device in str(err.value) and other in str(err.value)
        assert cache.get_seq_length() == 2 and torch.equal(cache.layers[0].keys.cpu(), before)
        # A new layer is refused too, before it is created.
        with pytest.raises(rewind.InvalidArgument):
            cache.update(kv(0, 1, device=other), kv(0, 1, device=other), 1)
        assert len(cache.layers) == 1


@pytest.mark.skipif(not CUDA_HERE, reason="needs a CUDA device (torch, rewind's build and the machine)")
def test_cuda_view_outlives_the_buffer():
    cache = rewind.DynamicCache(device="cuda")
    keys, _ = cache.update(kv(0, 2, device="cuda"), kv(0, 2, device="cuda"), 0)
    ptr = keys.data_ptr()
    for t in range(2, 200):  # grows: the buffer keys views is freed by the cache, kept by the pin
        cache.update(kv(t, 1, device="cuda"), kv(t, 1, device="cuda"), 0)
    assert rewind.pin_stats()["zombie_blocks"] >= 1
    assert keys.data_ptr() == ptr and positions(keys.cpu()) == [0, 1]
    del keys
    assert rewind.pin_stats()["zombie_blocks"] == 0


def test_cpu_storage_for_the_tests_applies_to_caches_made_after():
    """`_set_cpu_storage` (make test-python-guarded) puts new cpu caches on the guarded storage, results as copies."""
    with pytest.raises(ValueError, match=r"_set_cpu_storage\(\"pinned\"\): allowed: host, guarded"):
        rewind._rewind._set_cpu_storage("pinned")
    try:
        rewind._rewind._set_cpu_storage("host")
        on_host = rewind.DynamicLayer()
        on_host.update(kv(0, 2), kv(0, 2))
        rewind._rewind._set_cpu_storage("guarded")
        guarded = rewind.DynamicLayer()
        keys, _ = guarded.update(kv(0, 2), kv(0, 2))
        assert rewind._rewind._Device("cpu").storage == "guarded"
        assert guarded._kv.device.storage == "guarded" and guarded._kv.device.name == "cpu"
        assert on_host._kv.device.storage == "cpu"  # made before: unchanged
        assert keys.device == torch.device("cpu") and positions(keys) == [0, 1]
        keys[0, 0, 0, 0] = 99.0  # a copy: the cache does not see it
        assert positions(guarded.keys) == [0, 1]
        keys, _ = guarded.update(kv(2, 1), kv(2, 1))
        assert positions(keys) == [0, 1, 2]
        on_host.update(kv(2, 1), kv(2, 1))
        assert positions(on_host.keys) == [0, 1, 2]
    finally:
        rewind._rewind._set_cpu_storage(STORAGE)
