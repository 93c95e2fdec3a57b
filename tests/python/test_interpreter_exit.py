"""The interpreter exits cleanly (status 0, no fatal error) whatever Python objects rewind was handed.

rewind keeps its warning handler in a C++ static that outlives the interpreter; a Python callable left in it
was released after finalization and aborted the process (exit 134). Each case runs in a fresh interpreter, the
one running the tests, importing the same rewind module.
"""

import os
import subprocess
import sys

import rewind

# The directory that holds the rewind package under test, first on the child's path.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(rewind.__file__)))


def run_python(code):
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "Fatal Python error" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


# A positive crop is deprecated and warns once (after reset_one_time_warnings) through the handler.
POSITIVE_CROP = """
import torch
rewind.reset_one_time_warnings()
layer = rewind.DynamicLayer()
kv = torch.zeros(1, 2, 5, 4)
layer.update(kv, kv)
layer.crop(3)
assert layer.get_seq_length() == 3
"""


def test_builtin_handler_installed_at_exit():
    proc = run_python("import rewind\nrewind.set_warning_handler(print)\n")
    assert proc.stdout == "" and proc.stderr == ""


def test_warning_reaches_python_handler_and_exit_is_clean():
    proc = run_python("import rewind\nrewind.set_warning_handler(print)\n" + POSITIVE_CROP + "print('done')\n")
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[1] == "done", proc.stdout
    assert lines[0].startswith("rewind: crop(n) with n > 0") and "deprecated" in lines[0]
    assert proc.stderr == ""


def test_handler_closure_receives_the_message_once():
    code = (
        "import rewind\ngot = []\nrewind.set_warning_handler(lambda m: got.append(m))\n"
        + POSITIVE_CROP
        + "layer.crop(2)\n"  # one-time: no second message
        "print(len(got), got[0].startswith('rewind: crop(n) with n > 0'))\n"
    )
    assert run_python(code).stdout == "1 True\n"


def test_raising_handler_does_not_fail_the_crop():
    code = "import rewind\ndef h(m):\n    raise RuntimeError(m)\nrewind.set_warning_handler(h)\n" + POSITIVE_CROP
    assert run_python(code).stdout == ""


def test_none_restores_stderr():
    code = "import rewind\nrewind.set_warning_handler(print)\nrewind.set_warning_handler(None)\n" + POSITIVE_CROP
    proc = run_python(code)
    assert proc.stdout == ""
    assert proc.stderr.startswith("rewind: crop(n) with n > 0"), proc.stderr


def test_default_handler_turns_warning_into_future_warning():
    code = (
        "import warnings\nimport rewind\nwarnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        + "".join("    " + line + "\n" for line in POSITIVE_CROP.strip().splitlines())
        + "print([w.category.__name__ for w in caught])\n"
    )
    assert run_python(code).stdout == "['FutureWarning']\n"


def test_handler_installed_by_a_late_atexit_callback():
    # Registered before rewind's own exit hook, so it runs after it: the handler then outlives finalization.
    code = (
        "import atexit\natexit.register(lambda: __import__('rewind').set_warning_handler(print))\n"
        "import rewind\n"
    )
    run_python(code)


def test_python_functions_assigned_to_rewind_classes():
    code = """
import rewind
import rewind._rewind as core
classes = [rewind.DynamicCache, rewind.DynamicLayer, rewind.Model, rewind.Error, rewind.RollbackError]
classes += [c for c in vars(core).values() if isinstance(c, type)]
for i, cls in enumerate(classes):
    setattr(cls, "user_method_%d" % i, lambda self, i=i: i)
    setattr(cls, "user_static_%d" % i, staticmethod(lambda: None))
rewind.user_function = lambda: None
import sys
sys.user_function = lambda: None
print(len(classes) > 5, rewind.DynamicLayer().user_method_1())
"""
    assert run_python(code).stdout == "True 1\n"
