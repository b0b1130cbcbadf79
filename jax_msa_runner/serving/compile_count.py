"""Counts XLA backend compilations, process-wide, through a ``jax.monitoring`` listener.

``CompileCounter`` is the proof behind "serving never compiles after warm-up": a block that
only calls already-compiled executables records no compilation.
"""
from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_compiled: list[str] = []  # function name of every backend compilation, in order
_listener_installed = False


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _compiled.append(str(kwargs.get("fun_name", "")))


def compiled_names() -> list[str]:
    """Names of the functions compiled since the listener was installed (a copy)."""
    global _listener_installed
    with _lock:
        if not _listener_installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listener_installed = True
        return list(_compiled)


def compile_count() -> int:
    """XLA backend compilations in this process since the listener was installed."""
    return len(compiled_names())


class CompileCounter:
    """Context manager: ``.count`` compilations and their ``.names`` inside the block."""

    def __enter__(self):
        self._start = compile_count()
        self.names: list[str] = []
        self.count = 0
        return self

    def __exit__(self, *exc):
        self.names = compiled_names()[self._start:]
        self.count = len(self.names)
        return False

    @property
    def so_far(self) -> int:
        return compile_count() - self._start
