"""Save+load throughput of the offload-cpu data path vs plain torch ops.

``make bench`` runs :func:`main` (``python -m benchmarks offload``: this one alone;
``python plugins/offload-cpu/benchmarks/offload.py --help``: its options). With a
GPU it adds the GPU path's rows (blocks on the GPU, pool pinned).

Prints the data path's throughput as a ratio to plain torch ops copying the
same blocks between the same tensors in the same run (measured interleaved,
medians), so machine noise cancels:

* ``plain``: ``pool.index_copy_(0, slots, region.index_select(0, ids))`` and
  ``region.index_copy_(0, ids, pool.index_select(0, slots))`` on the int8 rows
  of the canonical view, i.e. the obvious implementation;
* ``plain-wide``: the same two ops on rows viewed as int64 (a tuned baseline).

The data path also does its bookkeeping (slot runs, index tensors) and, in the
``checksums`` row, checksums every block at save and verifies it at load
(XXH3-64 per slot); ``checksum`` alone is the hash over the batch's rows.

Saves into a fresh pool (pages not mapped yet: each 4 KiB faults on first
write) against saves into a mapped pool show what the background prefault
buys in steady state; ``prefault`` is its own mapping rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from kvc_offload_cpu.datapath import HostPool, RegionPlan, checksums, wide

GiB = float(1 << 30)


def _median(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(
    *,
    num_blocks: int = 4096,
    bytes_per_block: int = 64 * 1024,
    batch: int = 256,
    reps: int = 15,
    seed: int = 0,
) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    region = torch.randint(-128, 128, (num_blocks, bytes_per_block), generator=g, dtype=torch.int8)
    num_slots = 2 * batch
    ids_list = torch.randperm(num_blocks, generator=g)[:batch].tolist()
    # What the index hands out: free slots lowest first (a fresh or steady pool).
    slots_list = list(range(batch // 2, batch // 2 + batch))
    ids = torch.tensor(ids_list)
    slots = torch.tensor(slots_list)
    # A fragmented pool after many evictions: slots in random order.
    scattered_list = torch.randperm(num_slots, generator=g)[:batch].tolist()
    scattered = torch.tensor(scattered_list)

    pool = HostPool([RegionPlan(frozenset({0}), region, 0, bytes_per_block)], num_slots, pin=False)
    pool_ck = HostPool(
        [RegionPlan(frozenset({0}), region, 0, bytes_per_block)], num_slots, pin=False
    )
    plain_pool = torch.empty_like(pool.pools[0])
    for p in (*pool.pools, *pool_ck.pools, plain_pool):
        p.zero_()  # fault the pages in outside the timing

    def ours(pool: HostPool, checks: bool, where: list[int] = slots_list) -> Callable[[], object]:
        def go() -> object:
            pool.save(where, ids_list, [0] * len(where), with_checksums=checks)
            ok, _ = pool.load(where, ids_list, [0] * len(where), verify=checks)
            assert all(ok)
            return ok

        return go

    def plain() -> None:
        plain_pool.index_copy_(0, slots, region.index_select(0, ids))
        region.index_copy_(0, ids, plain_pool.index_select(0, slots))

    wide_pool, wide_region = wide(plain_pool), wide(region)

    def plain_wide() -> None:
        wide_pool.index_copy_(0, slots, wide_region.index_select(0, ids))
        wide_region.index_copy_(0, ids, wide_pool.index_select(0, slots))

    def plain_scattered() -> None:
        plain_pool.index_copy_(0, scattered, region.index_select(0, ids))
        region.index_copy_(0, ids, plain_pool.index_select(0, scattered))

    cases: dict[str, Callable[[], object]] = {
        "ours": ours(pool, False),
        "ours_checksums": ours(pool_ck, True),
        "plain": plain,
        "plain_wide": plain_wide,
        "ours_scattered": ours(pool, False, scattered_list),
        "plain_scattered": plain_scattered,
    }
    for fn in cases.values():
        fn()  # warm up
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):  # interleaved, so load on the machine hits every case alike
        for name, fn in cases.items():
            samples[name].append(_median(fn, 3))
    moved = 2 * batch * bytes_per_block  # save + load
    out = {f"{k}_gib_s": moved / statistics.median(v) / GiB for k, v in samples.items()}
    batch_bytes = batch * bytes_per_block
    rows = pool_ck.pools[0][slots_list[0] : slots_list[0] + batch]
    out["checksum_gib_s"] = batch_bytes / _median(lambda: checksums([rows], slots_list), reps) / GiB
    fresh, mapped, faults = [], [], []
    first = list(range(batch))
    # Above glibc's largest mmap threshold (32 MiB), so every pool is a fresh mapping
    # rather than heap memory a freed pool left mapped.
    fresh_slots = max(batch, -(-(64 << 20) // bytes_per_block))
    for _ in range(max(3, reps // 3)):
        new = HostPool(
            [RegionPlan(frozenset({0}), region, 0, bytes_per_block)], fresh_slots, pin=False
        )
        fresh.append(new.save(first, ids_list, [0] * len(first), with_checksums=False))
        mapped.append(new.save(first, ids_list, [0] * len(first), with_checksums=False))
        del new
        new = HostPool(
            [RegionPlan(frozenset({0}), region, 0, bytes_per_block)], fresh_slots, pin=False
        )
        faults.append(new.prefault() * batch / fresh_slots)  # per batch of bytes
        del new
    out["save_fresh_gib_s"] = batch_bytes / statistics.median(fresh) / GiB
    out["save_mapped_gib_s"] = batch_bytes / statistics.median(mapped) / GiB
    out["prefault_gib_s"] = batch_bytes / statistics.median(faults) / GiB
    out["ratio_checksums_vs_none"] = out["ours_checksums_gib_s"] / out["ours_gib_s"]
    out["ratio_mapped_vs_fresh"] = out["save_mapped_gib_s"] / out["save_fresh_gib_s"]
    out["ratio_vs_plain"] = out["ours_gib_s"] / out["plain_gib_s"]
    out["ratio_vs_plain_wide"] = out["ours_gib_s"] / out["plain_wide_gib_s"]
    out["ratio_checksums_vs_plain"] = out["ours_checksums_gib_s"] / out["plain_gib_s"]
    out["ratio_checksums_vs_plain_wide"] = out["ours_checksums_gib_s"] / out["plain_wide_gib_s"]
    out["ratio_scattered_vs_plain"] = out["ours_scattered_gib_s"] / out["plain_scattered_gib_s"]
    out["batch_mib"] = batch * bytes_per_block / 2**20
    # Correctness of what was timed: the blocks went through the pool and back intact.
    assert torch.equal(pool.slot(scattered_list[0]), region[ids_list[0]])
    assert torch.equal(pool_ck.slot(slots_list[-1]), region[ids_list[-1]])
    return out


def run_gpu(
    *, num_blocks: int = 4096, bytes_per_block: int = 64 * 1024, batch: int = 256, reps: int = 15
) -> dict[str, float]:  # pragma: no cover - needs a GPU
    """The GPU path: vLLM's blocks on the GPU, the pool pinned host memory.

    Checks first that the bytes make the round trip (save, then load into other
    blocks) and that a load has finished reading its slots when it returns, so
    that the scheduler may hand them to the next save at once: the slots are
    overwritten right after the load, then the blocks are compared.
    """
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    region = torch.randint(
        -128, 128, (num_blocks, bytes_per_block), generator=g, dtype=torch.int8
    ).to(dev)
    pool = HostPool([RegionPlan(frozenset({0}), region, 0, bytes_per_block)], 2 * batch, pin=True)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    ids_list, dst_list = perm[:batch], perm[batch : 2 * batch]
    slots_list = list(range(batch))
    groups = [0] * batch
    want = region[torch.tensor(ids_list, device=dev)].cpu()
    pool.save(slots_list, ids_list, groups, with_checksums=True)
    assert torch.equal(pool.pools[0][:batch], want), "save: the pool holds other bytes"
    region[torch.tensor(dst_list, device=dev)] = 0
    ok, _ = pool.load(slots_list, dst_list, groups, verify=True)
    assert all(ok)
    pool.pools[0][:batch].fill_(-1)  # the slots reused right after the load returned
    torch.cuda.synchronize()
    got = region[torch.tensor(dst_list, device=dev)].cpu()
    assert torch.equal(got, want), "load: the slots were read after it returned"
    ids_d = torch.tensor(ids_list, device=dev)
    dst_d = torch.tensor(dst_list, device=dev)
    slots = torch.tensor(slots_list)
    plain_pool = torch.empty_like(pool.pools[0]).pin_memory()

    def ours() -> None:
        pool.save(slots_list, ids_list, groups, with_checksums=False)
        pool.load(slots_list, dst_list, groups, verify=False)
        torch.cuda.synchronize()

    def plain() -> None:
        plain_pool.index_copy_(0, slots, region.index_select(0, ids_d).cpu())
        region.index_copy_(0, dst_d, plain_pool.index_select(0, slots).to(dev))
        torch.cuda.synchronize()

    cases = {"gpu_ours": ours, "gpu_plain": plain}
    for fn in cases.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            samples[name].append(_median(fn, 3))
    moved = 2 * batch * bytes_per_block
    out = {f"{k}_gib_s": moved / statistics.median(v) / GiB for k, v in samples.items()}
    out["gpu_ratio_vs_plain"] = out["gpu_ours_gib_s"] / out["gpu_plain_gib_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--blocks", type=int, default=4096, help="blocks in the KV cache")
    ap.add_argument("--block-kib", type=int, default=64, help="KiB per block (all layers)")
    ap.add_argument("--batch", type=int, default=256, help="blocks saved and loaded per call")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args([] if argv is None else argv)
    r = run(
        num_blocks=args.blocks,
        bytes_per_block=args.block_kib * 1024,
        batch=args.batch,
        reps=args.reps,
    )
    print(
        f"offload-cpu data path: {args.batch} blocks x {args.block_kib} KiB "
        f"({r['batch_mib']:.0f} MiB) saved then loaded, torch threads={torch.get_num_threads()}"
    )
    for name in (
        "ours",
        "ours_checksums",
        "plain",
        "plain_wide",
        "ours_scattered",
        "plain_scattered",
    ):
        print(f"  {name:<16} {r[name + '_gib_s']:7.2f} GiB/s")
    print(f"  ratio ours / plain (int8 index_select+index_copy_):  {r['ratio_vs_plain']:.2f}x")
    print(f"  ratio ours / plain on int64 rows:                    {r['ratio_vs_plain_wide']:.2f}x")
    print(
        f"  ratio ours+checksums / plain:                        "
        f"{r['ratio_checksums_vs_plain']:.2f}x"
    )
    print(
        f"  ratio ours+checksums / plain on int64 rows:          "
        f"{r['ratio_checksums_vs_plain_wide']:.2f}x"
    )
    print(
        f"  ratio ours / plain, slots scattered over the pool:   "
        f"{r['ratio_scattered_vs_plain']:.2f}x"
    )
    print(f"  checksum (XXH3-64) alone      {r['checksum_gib_s']:7.2f} GiB/s")
    print(
        f"  ratio ours+checksums / ours (cost of checksums):     "
        f"{r['ratio_checksums_vs_none']:.2f}x"
    )
    print(f"  save into a fresh pool        {r['save_fresh_gib_s']:7.2f} GiB/s (pages fault)")
    print(f"  save into a mapped pool       {r['save_mapped_gib_s']:7.2f} GiB/s")
    print(f"  prefault (MADV_POPULATE_WRITE){r['prefault_gib_s']:7.2f} GiB/s")
    print(
        f"  ratio save mapped / fresh (what the prefault buys):  {r['ratio_mapped_vs_fresh']:.2f}x"
    )
    if not torch.cuda.is_available():
        print("  GPU path (pinned pool, side-stream copies): not measured, no GPU here")
        return 0
    g = run_gpu(  # pragma: no cover - needs a GPU
        num_blocks=args.blocks,
        bytes_per_block=args.block_kib * 1024,
        batch=args.batch,
        reps=args.reps,
    )
    print(f"  GPU ({torch.cuda.get_device_name()}), blocks on the GPU, pool pinned; bytes checked")
    print(f"  gpu ours          {g['gpu_ours_gib_s']:7.2f} GiB/s")
    print(f"  gpu plain         {g['gpu_plain_gib_s']:7.2f} GiB/s (index_select, .cpu(), .to())")
    print(f"  ratio gpu ours / plain:                              {g['gpu_ratio_vs_plain']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
