"""What it costs to fault back in pages that were given back: the price of stage 3's page release.

    .venv/bin/python benchmarks/bench_page_refill.py [--mib 364] [--piece-mib 27] [--repeat 3]
        [--out benchmarks/out/page_refill.json]

Stage 3 drops the pages of every released unit, lent chunk and gradient chunk ([Note: releasing a
gathered unit's pages] in zeroshard/host/page_release.py) and faults them in again when the buffer
is next written.  What that costs depends on the host, not on zeroshard: on a virtual machine whose
guest reports free memory to the hypervisor (virtio-balloon free page reporting), pages that stay free
long enough are taken back by the host, and touching them again costs a fault in the host as well.
This measures, in one process and with the buffers zeroshard uses (``prefer_huge_pages``,
``release_pages``), filling ``--mib`` MiB:

- with its pages kept (written before, never dropped);
- after its pages were dropped, ``delay`` seconds earlier (0 to 4 s);
- as ``--piece-mib`` pieces, each written right after another buffer's piece of the same size was
  dropped, when the written buffer's own pages were dropped 4 s earlier (the kernel can hand the pages
  just freed straight back).

Prints a table, the kernel's page-reporting settings where it has them, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zeroshard.host.page_release import can_release_pages, prefer_huge_pages, release_pages  # noqa: E402

MIB = 1 << 20
DELAYS = (0.0, 0.5, 1.0, 2.0, 4.0)
COLD_S = 4.0  # long enough for this project's VM to have reported the pages (see the table)


def _fill_seconds(buffers: list[torch.Tensor], before_each=None) -> float:
    start = time.perf_counter()
    for i, buffer in enumerate(buffers):
        if before_each is not None:
            before_each(i)
        buffer.fill_(1.0)
    return time.perf_counter() - start


def _buffers(total_mib: int, piece_mib: int) -> list[torch.Tensor]:
    pieces = [torch.empty(piece_mib * MIB // 4) for _ in range(max(1, total_mib // piece_mib))]
    for piece in pieces:
        prefer_huge_pages(piece)
        piece.fill_(1.0)  # first touch, so that every case below starts from pages the process has had
    return pieces


def _release(buffers: list[torch.Tensor]) -> None:
    for buffer in buffers:
        release_pages(buffer)


def kernel_settings() -> dict[str, str]:
    """The transparent-huge-page mode and the free-page-reporting module's parameters, where present."""
    found = {}
    for path in [Path("/sys/kernel/mm/transparent_hugepage/enabled"),
                 *sorted(Path("/sys/module/page_reporting/parameters").glob("*"))]:
        try:
            found[str(path)] = path.read_text().strip()
        except OSError:
            continue
    return found


def measure(total_mib: int, piece_mib: int, repeat: int) -> dict[str, list[float]]:
    a, b = _buffers(total_mib, piece_mib), _buffers(total_mib, piece_mib)
    results: dict[str, list[float]] = {"kept": [], "swap after a drop of the same size": []}
    for _ in range(repeat):
        results["kept"].append(_fill_seconds(a))
        for delay in DELAYS:
            _release(a)
            time.sleep(delay)
            results.setdefault(f"dropped {delay:g} s before", []).append(_fill_seconds(a))
        _release(b)  # b's pages go cold, a's are resident: drop a's piece i, then write b's piece i
        time.sleep(COLD_S)
        results["swap after a drop of the same size"].append(
            _fill_seconds(b, before_each=lambda i: release_pages(a[i])))
        _fill_seconds(a)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=364, help="bytes filled per case (91M fp32 parameters: 364)")
    parser.add_argument("--piece-mib", type=int, default=27, help="one buffer (a 91M GPT's stage-3 unit: 27)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out/page_refill.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not can_release_pages(torch.empty(0)):
        raise SystemExit("bench_page_refill: pages cannot be released here (needs host memory on Linux)")
    results = measure(args.mib, args.piece_mib, args.repeat)
    settings = kernel_settings()
    total = args.mib // args.piece_mib * args.piece_mib
    print(f"\nfilling {total} MiB in {args.piece_mib} MiB buffers (huge pages asked), median of {args.repeat}\n")
    print("| pages | fill (s) | GiB/s |")
    print("| --- | --- | --- |")
    for case, seconds in results.items():
        median = statistics.median(seconds)
        print(f"| {case} | {median:.3f} | {total / 1024 / median:.1f} |")
    print("\nkernel:", json.dumps(settings, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"mib": total, "piece_mib": args.piece_mib, "seconds": results,
                               "kernel": settings}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
