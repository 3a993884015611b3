"""diffrl.lazy: a deferred module loads once, on first use, and is safe to first touch from many threads."""

import subprocess
import sys
import textwrap


def test_first_use_from_many_threads_at_once_sees_the_whole_module():
    # A fresh interpreter, so the module is really imported by the racing threads.
    code = textwrap.dedent(
        """
        import sys, threading
        from diffrl.lazy import is_deferred, lazy_import

        np = lazy_import("numpy")  # ~0.1 s to import: a wide window for the threads to race in
        assert "numpy" not in sys.modules and is_deferred(np)
        errors, start = [], threading.Barrier(16)

        def use():
            start.wait()
            try:
                assert int(np.add(np.int64(1), 2)) == 3
            except Exception as err:  # an empty half-initialised module raises AttributeError
                errors.append(repr(err))

        threads = [threading.Thread(target=use) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert not is_deferred(np) and np.ndarray is sys.modules["numpy"].ndarray
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_an_already_imported_module_is_returned_as_is_and_a_missing_one_raises():
    import pytest

    from diffrl.lazy import lazy_import

    assert lazy_import("os") is sys.modules["os"]
    with pytest.raises(ModuleNotFoundError, match="no_such_module_here"):
        lazy_import("no_such_module_here")
