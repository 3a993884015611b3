"""diffrl.lazy: a deferred module loads once, on first use, and is safe to first touch from many threads."""

import os
import subprocess
import sys
import textwrap


def test_first_use_from_many_threads_at_once_sees_the_whole_module(tmp_path):
    # A module of our own that takes 0.2 s to execute, so the racing threads really import it
    # (whatever `import diffrl` imports) and the window for seeing it half-initialised is wide.
    (tmp_path / "slow_to_import.py").write_text(
        "import time\ntime.sleep(0.2)\n\ndef add(a, b):\n    return a + b\n\nVALUE = 3\n"
    )
    code = textwrap.dedent(
        """
        import sys, threading
        from diffrl.lazy import is_deferred, lazy_import

        mod = lazy_import("slow_to_import")
        assert "slow_to_import" not in sys.modules and is_deferred(mod)
        errors, start = [], threading.Barrier(16)

        def use():
            start.wait()
            try:
                assert mod.add(1, 2) == mod.VALUE
            except Exception as err:  # an empty half-initialised module raises AttributeError
                errors.append(repr(err))

        threads = [threading.Thread(target=use) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert not is_deferred(mod) and mod.add is sys.modules["slow_to_import"].add
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_an_already_imported_module_is_returned_as_is_and_a_missing_one_raises():
    import pytest

    from diffrl.lazy import lazy_import

    assert lazy_import("os") is sys.modules["os"]
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):
        lazy_import("no_such_module_here")
