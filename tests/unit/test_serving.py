"""What every service's process does with signals on its way out (``serving.stop_on_signals``,
``serving.run_service``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# a service's life in miniature: its loop handles SIGTERM by stopping, the loop ends, and a SIGTERM then
# arrives before the process has exited (a launcher stopping every process just after asking the services
# to shut down)
_SERVICE = textwrap.dedent(
    """
    import asyncio, os, signal
    from bagpipe import serving

    async def body():
        stop = asyncio.Event()
        serving.stop_on_signals(stop)
        os.kill(os.getpid(), signal.SIGTERM)  # while serving: it stops
        await asyncio.wait_for(stop.wait(), 10)

    asyncio.run(body())
    {after_loop}
    print("exited cleanly", flush=True)
    """
)


def _run(after_loop: str) -> subprocess.CompletedProcess[str]:
    code = _SERVICE.format(after_loop=after_loop)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_sigterm_after_the_service_loop_ended_does_not_kill_it() -> None:
    """Closing an event loop puts back the default action of the signals it handled (exit -15); the
    services' handlers are the process's, so a SIGTERM between the loop's end and the process's is
    harmless."""
    done = _run("os.kill(os.getpid(), signal.SIGTERM)")
    assert done.returncode == 0 and "exited cleanly" in done.stdout, (done.returncode, done.stderr)


def test_the_service_body_returning_leaves_sigterm_ignored() -> None:
    done = _run(
        "serving.run_service(lambda: None, 'test')\n"
        "assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN\n"
        "os.kill(os.getpid(), signal.SIGTERM)"
    )
    assert done.returncode == 0 and "exited cleanly" in done.stdout, (done.returncode, done.stderr)
