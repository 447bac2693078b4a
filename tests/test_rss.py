"""recjax/rss.py: the sampled peaks of the process's own memory and of its mapped files see allocations of known
sizes made and freed between two reads of them (so only the sampling thread can have seen them)."""

import mmap
import sys
import time

import numpy as np
import pytest
from conftest import HANG_GUARD_S

from recjax.rss import RssSampler, resident

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")

MIB = 1 << 20


def wait_for(condition) -> None:
    """Until the sampling thread saw it: no time budget (a loaded machine runs it late), a guard against a hang."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < HANG_GUARD_S, "the sampler never saw the allocation"
        time.sleep(0.01)


def test_peaks_split_own_memory_from_mapped_files(tmp_path):
    now = resident()
    assert now["anon"] + now["file"] + now["shmem"] == now["total"]  # the kernel's own split of VmRSS
    with RssSampler(interval_s=0.01) as sampler:
        base = dict(sampler.peaks)
        own = np.ones(160 * MIB // 8)  # 160 MiB written: the process's own pages
        wait_for(lambda: sampler.peaks["anon"] >= base["anon"] + 150 * MIB)
        del own
        path = tmp_path / "mapped.bin"
        path.write_bytes(b"\x01" * (96 * MIB))
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            assert sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE)) == 96 * MIB // mmap.PAGESIZE
            wait_for(lambda: sampler.peaks["file"] >= base["file"] + 90 * MIB)
    summary = sampler.summary()
    assert summary["peak_rss_anon_bytes"] >= base["anon"] + 150 * MIB
    assert summary["peak_rss_file_bytes"] >= base["file"] + 90 * MIB
    # Both were freed before the summary was read: only the sampled peaks hold them.
    assert resident()["file"] < summary["peak_rss_file_bytes"] - 80 * MIB
