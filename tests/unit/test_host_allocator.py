"""``host_memory_release``: after initialize(), glibc maps (and on free unmaps) every block of a MiB or more,
where by default it serves them from a heap that keeps freed memory (see [Note: glibc keeps what training
frees]).  ``host_memory_trim``: every optimizer step gives the heap's free pages back.  Run in fresh
processes: both settings act on the whole process."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import ctypes, sys, torch, zeroshard
    from torch import nn

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def mapped(nbytes):
        before = libc.mallinfo2().hblks
        block = torch.empty(nbytes, dtype=torch.uint8)
        count = libc.mallinfo2().hblks - before
        del block
        return count

    warm = torch.empty(24 << 20, dtype=torch.uint8)
    del warm  # glibc raises its mmap threshold to 24 MiB: later blocks below it come from the heap
    default = mapped(2 << 20)
    engine, *_ = zeroshard.initialize(model=nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
        "host_memory_release": sys.argv[1] == "on"})
    print(default, mapped(2 << 20), mapped(256 << 10))
""")


def run(setting: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, setting], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [int(v) for v in out.stdout.split()]


@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_host_memory_release_maps_blocks_of_a_mib_or_more() -> None:
    assert run("off") == [0, 0, 0]  # glibc's default: served from the heap, kept when freed
    assert run("on") == [0, 1, 0]  # from initialize() on: a 2 MiB block is its own mapping; 256 KiB is not


TRIM_SCRIPT = textwrap.dedent("""
    import sys, torch, zeroshard
    from torch import nn

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    engine, *_ = zeroshard.initialize(model=nn.Linear(4, 4), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"},
        "host_memory_trim": sys.argv[1] == "on"})
    # 160 MiB in 64 KiB blocks (below glibc's mmap threshold: from the heap), touched, then freed but
    # the last one, which keeps the heap's top in use so that free() itself returns nothing
    blocks = [torch.ones(16 << 10) for _ in range(2560)]
    keep = blocks.pop()
    del blocks
    before = rss_mib()
    engine.backward(engine(torch.ones(1, 4)).sum())
    engine.step()
    print(round(before - rss_mib()))
""")


def trimmed_mib(setting: str) -> int:
    out = subprocess.run([sys.executable, "-c", TRIM_SCRIPT, setting], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_host_memory_trim_returns_the_heaps_free_pages_after_each_step() -> None:
    assert trimmed_mib("off") < 20  # glibc's default: the freed 160 MiB stay resident
    assert trimmed_mib("on") > 140  # the step gave them back
