"""The process's resident memory as /proc/self/status splits it: its own memory (RssAnon: the heap, numpy and device
arrays on a CPU, the compiled programs) and the file-backed pages it maps (RssFile: the libraries, and any mapped
file). The kernel keeps the peak of the total only (VmHWM), so `RssSampler` samples both parts on a thread and keeps
their peaks: a run's summary reports how much of its peak was its own and how much mapped files, which the total
alone hides (a disk tier that mapped its table files once held more of them than of its own memory).

Linux only; elsewhere the figures are None.
"""

import pathlib
import threading

STATUS = pathlib.Path("/proc/self/status")
FIELDS = {"VmHWM": "peak", "VmRSS": "total", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def resident() -> dict[str, int] | None:
    """{"total", "anon", "file", "shmem", "peak"} in bytes now ("peak": the kernel's VmHWM), or None off Linux."""
    try:
        text = STATUS.read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[FIELDS[key]] = int(value.split()[0]) * 1024  # kB
    return out if len(out) == len(FIELDS) else None


class RssSampler:
    """Samples `resident()` every `interval_s` on a daemon thread (and whenever `sample` is called) and keeps the
    peaks of the total, own (anon) and file-backed parts. Use as a context manager, or `start` / `stop`."""

    def __init__(self, interval_s: float = 0.05):
        self.interval_s = interval_s
        self.peaks = {"total": 0, "anon": 0, "file": 0}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, int] | None:
        now = resident()
        if now is not None:
            with self._lock:
                for key in self.peaks:
                    self.peaks[key] = max(self.peaks[key], now[key])
        return now

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> "RssSampler":
        if self.sample() is not None and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="recjax-rss")
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "RssSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict[str, int | None]:
        """summary.json's split of the peak RSS, sampled now too: the sampled peaks of the process's own memory
        (RssAnon) and of the file-backed pages it maps (RssFile); None off Linux."""
        if self.sample() is None:
            return {"peak_rss_anon_bytes": None, "peak_rss_file_bytes": None}
        with self._lock:
            return {"peak_rss_anon_bytes": self.peaks["anon"], "peak_rss_file_bytes": self.peaks["file"]}
