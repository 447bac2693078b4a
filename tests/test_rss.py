"""recjax/rss.py: the sampled peaks of the process's own memory and of its mapped files see allocations of known
sizes made and freed between two reads of them (so only the sampling thread can have seen them)."""

import gc
import mmap
import sys
import time

import numpy as np
import pytest

from recjax.rss import RssSampler, resident

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")

MIB = 1 << 20
GUARD_S = 600  # the sampler's 10 ms period, times 60,000


def wait_for(condition, sampler) -> None:
    """Until the sampling thread saw it (every 10 ms; a loaded machine runs it late), with a guard against a hang."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < GUARD_S, f"the sampler never saw it: peaks {sampler.peaks}, now {resident()}"
        time.sleep(0.01)


def test_peaks_split_own_memory_from_mapped_files(tmp_path):
    now = resident()
    assert now["anon"] + now["file"] + now["shmem"] == now["total"]  # the kernel's own split of VmRSS
    with RssSampler(interval_s=0.01) as sampler:
        # The marks are the memory just before each allocation, not the sampler's first peaks: a process that freed
        # memory since (a finished test's arrays, a collected cycle) may never climb 150 MiB above its old peak.
        gc.collect()
        before = resident()
        own = np.ones(160 * MIB // 8)  # 160 MiB written: the process's own pages
        wait_for(lambda: sampler.peaks["anon"] >= before["anon"] + 150 * MIB, sampler)
        del own
        path = tmp_path / "mapped.bin"
        path.write_bytes(b"\x01" * (96 * MIB))
        before_map = resident()
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            assert sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE)) == 96 * MIB // mmap.PAGESIZE
            if resident()["shmem"] >= before_map["shmem"] + 90 * MIB:
                pytest.skip("tmp_path is on a tmpfs: its mapped pages count as RssShmem, not RssFile")
            wait_for(lambda: sampler.peaks["file"] >= before_map["file"] + 90 * MIB, sampler)
    summary = sampler.summary()
    assert summary["peak_rss_anon_bytes"] >= before["anon"] + 150 * MIB
    assert summary["peak_rss_file_bytes"] >= before_map["file"] + 90 * MIB
    # Both were freed before the summary was read: only the sampled peaks hold them.
    assert resident()["file"] < summary["peak_rss_file_bytes"] - 80 * MIB
