"""The allocator settings: who counts as having chosen an allocator, and what keep_freed_memory does to glibc."""

import json
import os
import platform
import subprocess
import sys

import pytest

from mhgpo.cli import main as cli
from mhgpo.model.allocator import user_chose_allocator


@pytest.mark.parametrize(
    "environ, chosen",
    [
        ({}, None),
        ({"PATH": "/usr/bin", "LD_PRELOAD": ""}, None),
        ({"MHGPO_MALLOC": "default"}, "MHGPO_MALLOC"),
        ({"MHGPO_MALLOC": "keep"}, None),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
        ({"LD_PRELOAD": "/opt/libtcmalloc_minimal.so"}, "LD_PRELOAD"),
        ({"LD_PRELOAD": "/opt/libfaketime.so"}, None),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES"),
        ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2048"}, None),
        ({"MALLOC_ARENA_MAX": "2"}, None),  # not a malloc parameter variable (those end in an underscore)
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
    ],
)
def test_user_chose_allocator(environ, chosen):
    assert user_chose_allocator(environ) == chosen


# In a fresh interpreter: call keep_freed_memory, then malloc 8 MiB and count glibc's mmapped blocks before and after
PROBE = """
import ctypes, json
from mhgpo.model.allocator import keep_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
applied = keep_freed_memory()
again = keep_freed_memory()
before = libc.mallinfo2().hblks
block = libc.malloc(8 << 20)
after = libc.mallinfo2().hblks
libc.free(ctypes.c_void_p(block))
print(json.dumps({"applied": applied, "again": again, "new_mmapped_blocks": after - before}))
"""


def probe(**env: str) -> dict:
    environ = {
        k: v
        for k, v in os.environ.items()
        if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", "MHGPO_MALLOC") and not k.startswith("MALLOC_")
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**environ, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator")


@glibc
def test_keep_freed_memory_serves_large_blocks_from_the_heap():
    assert probe() == {"applied": True, "again": True, "new_mmapped_blocks": 0}


@glibc
def test_keep_freed_memory_leaves_the_users_choice_alone():
    # glibc's default: a fresh 8 MiB block is mapped on its own (the threshold starts at 128 KiB)
    assert probe(MHGPO_MALLOC="default") == {"applied": False, "again": False, "new_mmapped_blocks": 1}


class Stop(Exception):
    pass


def test_the_command_sets_the_allocator_before_it_parses(monkeypatch):
    calls = []

    def parser():
        calls.append("parser")
        raise Stop

    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append("allocator"))
    monkeypatch.setattr(cli, "build_parser", parser)
    with pytest.raises(Stop):
        cli.main(["eval"])
    assert calls == ["allocator", "parser"]
