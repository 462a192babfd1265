import sys
import threading

import pytest

from pagedkv.runtime import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux names")


def os_name(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


@pytest.mark.parametrize(
    ("name", "shown"),
    [("pagedkv-engine", "pagedkv-engine"), ("a-name-longer-than-15", "a-name-longer-t")],
)
def test_a_thread_names_itself_for_the_os_and_no_other(name, shown):
    """The calling thread's name in /proc (cut to 15 bytes) changes; the
    main thread's does not."""
    main = os_name(threading.main_thread().native_id)
    got = {}

    def run():
        got["before"] = os_name(threading.get_native_id())
        got["ok"] = name_os_thread(name)
        got["after"] = os_name(threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got["ok"] is True
    assert got["before"] != shown
    assert got["after"] == shown
    assert os_name(threading.main_thread().native_id) == main


@pytest.mark.parametrize("name", [None, b"engine", 7])
def test_a_name_that_is_not_a_string_is_refused(name):
    with pytest.raises(TypeError, match="string"):
        name_os_thread(name)
