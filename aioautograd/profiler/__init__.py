"""Engine profiler: which node ran when, on which device and executor thread, for which
graph task; exported as a Chrome/Perfetto trace or drawn as a matplotlib timeline."""

from aioautograd.profiler.recorder import NodeEvent, profile, record_function
from aioautograd.profiler.trace import plot_timeline, to_chrome_trace

__all__ = ["NodeEvent", "plot_timeline", "profile", "record_function", "to_chrome_trace"]
