"""Running a launch's replicas in new processes (the CPU runtime's thread replicas, SPMD, the native
strategies' ranks other than 0).

A new process gets a clean XLA runtime configured by environment variables, whatever the
calling process (a script, a notebook, a test session) has already done with its own.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

from xtrainer.launch import interrupts

_environ_lock = threading.Lock()
#: Set in a started process: where to leave word that it was asked to start one of its own while
#: it imported the caller's script (the script starts training at import time).
_UNGUARDED_MARKER = "XTRAINER_UNGUARDED_MAIN_MARKER"
_UNGUARDED_MESSAGE = (
    "The script starts training when it is imported: the new process that runs the replicas imports "
    "it again (Python's 'spawn' start method), and it tried to start training there too. Put the "
    "script's work under `if __name__ == '__main__':` (define the classes and functions above it).")


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while a child process starts (it copies the environment)."""
    with _environ_lock:
        saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def run_in_new_process(target: Callable[..., None], args: tuple, env: dict[str, str], what: str) -> int:
    """``target(*args)`` in a new (spawned) process started with ``env``; its exit code.

    ``args`` are pickled: a clear error says what to change when they cannot be. Interrupting
    the caller (Ctrl-C) ends the process too.
    """
    return run_in_new_processes(target, args, [env], what)


def run_in_new_processes(target: Callable[..., None], args: tuple, envs: list[dict[str, str]], what: str,
                         codes: list[int | None] | None = None, hookless_tensors: bool = False) -> int:
    """``target(*args)`` in one new (spawned) process per item of ``envs``, each started with its
    environment; the first non-zero exit code among them (0 if all end well). ``codes``, if
    given, receives every process's exit code, in the order of ``envs`` (None for one this
    function ended itself, after another had failed). ``hookless_tensors``: the tensors in
    ``args`` are rebuilt without the backward hooks torch's unpickling gives them
    (``_JobUnpickler``).

    When one process ends with an error, the others are ended too (they may be waiting for it in
    a collective). Stop signals the caller receives are forwarded to every process.
    """
    with new_processes(target, args, envs, what, hookless_tensors) as started:
        return started.join(codes)


class NewProcesses:
    """The processes ``new_processes`` started, while the caller works beside them."""

    def __init__(self, processes: list, marker: str, unpickling: str, what: str) -> None:
        self.processes, self.marker, self.unpickling, self.what = processes, marker, unpickling, what

    def ended(self) -> list[int]:
        """The indices of the processes that have ended (without waiting for the others)."""
        return [index for index, process in enumerate(self.processes) if process.exitcode is not None]

    def end(self, grace: float = 0.0, patience: float = 10.0) -> None:
        """End the processes still running after ``grace`` seconds (SIGTERM, then SIGKILL after
        ``patience`` more)."""
        _end(self.processes, grace, patience)

    def join(self, codes: list[int | None] | None = None) -> int:
        """Wait for every process (once one fails, the others are ended); the first non-zero exit
        code (0 if all ended well), and ``codes`` as ``run_in_new_processes`` gives them. Raises
        what a process left word of: it imported an unguarded script, or could not rebuild its job."""
        try:
            exitcode = _join_all(self.processes)
        except BaseException:  # a second Ctrl-C: do not leave the replicas running
            _end(self.processes)
            raise
        if codes is not None:
            codes[:] = [None if getattr(process, "ended_by_caller", False) else process.exitcode
                        for process in self.processes]
        if os.path.exists(self.marker):
            os.remove(self.marker)
            raise RuntimeError(_UNGUARDED_MESSAGE)
        if os.path.exists(self.unpickling):
            with open(self.unpickling) as f:
                why = f.read()
            os.remove(self.unpickling)
            raise RuntimeError(f"{self.what}: a new process could not rebuild what it was sent (the trainer, the "
                               f"module, the callbacks and the dataloaders, pickled): {why}. The new process imports "
                               "the script again as a module, without running what is under `if __name__ == "
                               "'__main__':`; define the classes and functions the run uses above it, at the top level "
                               "of a file (not in standard input or a notebook cell), or in a module of their own.")
        return exitcode


@contextlib.contextmanager
def new_processes(target: Callable[..., None], args: tuple, envs: list[dict[str, str]], what: str,
                  hookless_tensors: bool = False) -> Iterator[NewProcesses]:
    """``run_in_new_processes``'s processes, started (``args`` pickled now, once) and handed to the
    caller, which may work beside them before it joins them (``NewProcesses.join``). Stop signals
    the caller receives are forwarded to every process while this lasts; leaving it with an error
    ends those still running."""
    context = multiprocessing.get_context("spawn")
    inherited_marker = os.environ.get(_UNGUARDED_MARKER)  # set if this is a started process itself
    marker = os.path.join(tempfile.gettempdir(), f"xtrainer-unguarded-{os.getpid()}-{id(args)}")
    # Pickled here with the plain pickler, once, into bytes that every process unpickles for itself.
    # multiprocessing's own pickler would hand each tensor over as a reference to shared memory: the
    # processes would all train the same weights, the caller's own tensors would be moved into shared
    # memory, and a tensor made only while pickling (a torch.Generator's state, from its __reduce__)
    # is freed in the caller before a process can map it ("unable to resize file" there).
    unpickling = marker + ".unpickling"  # where a process that cannot rebuild the job says why
    # Handed over in a private folder, one hard link per process that it reads and removes: the
    # bytes are as large as the job (an in-memory dataset, say). Not through the process's start
    # pipe: multiprocessing keeps its end open while writing, so a process that died while
    # importing the script (before reading) left start() blocked for good on a job past the
    # pipe's 64 KiB, and no signal ended the caller.
    folder = tempfile.mkdtemp(prefix="xtrainer-job-")
    try:
        job = os.path.join(folder, "job")
        try:
            data = pickle.dumps((target, args))
        except (pickle.PicklingError, AttributeError, TypeError) as err:
            raise TypeError(_unpicklable(what, err)) from err
        try:
            with open(job, "wb") as f:
                f.write(data)
        except OSError as err:
            raise OSError(err.errno, f"{what} hands the pickled job ({len(data) / 2**20:.1f} MiB) to its processes "
                                     f"through a file in {tempfile.gettempdir()}, and writing it failed: "
                                     f"{err.strerror}. Free space there, or point TMPDIR elsewhere.") from err
        del data
        processes = _start_all(context, envs, job, marker, inherited_marker, unpickling, hookless_tensors)
        os.remove(job)  # each process reads its own link
        try:
            with contextlib.ExitStack() as stack:
                for process in processes:  # SIGTERM/SIGINT reach the replicas through here
                    stack.enter_context(interrupts.forwarding_to(process.pid))
                yield NewProcesses(processes, marker, unpickling, what)
        except BaseException:
            _end(processes)
            raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the links of processes that never read theirs


def _unpicklable(what: str, err: BaseException) -> str:
    return (f"{what} sends the trainer, the module, the callbacks and the dataloaders to a new process by "
            f"pickling them, and that failed: {err}. Define classes and functions at the top level of a "
            "module (not inside a function or a notebook cell's function), and start the script's work "
            "under `if __name__ == '__main__':`.")


def _start_all(context: Any, envs: list[dict[str, str]], job: str, marker: str, inherited_marker: str | None,
               unpickling: str, hookless_tensors: bool) -> list:
    """One started process per item of ``envs``, each given a hard link to the pickled ``job``."""
    processes: list = []
    try:
        for index, env in enumerate(envs):
            link = f"{job}.{index}"
            try:
                os.link(job, link)
            except OSError:  # a file system without hard links: a copy
                shutil.copyfile(job, link)
            child_args = (_unpickled_main, (link, unpickling, hookless_tensors), os.getpid())
            with _environ({**env, _UNGUARDED_MARKER: marker}):
                process = context.Process(target=_child_main, args=child_args, name="xtrainer-replicas")
                try:
                    process.start()
                except RuntimeError as err:
                    if "bootstrapping phase" not in str(err) or inherited_marker is None:
                        raise
                    # This is the started process, importing the caller's unguarded script: tell the caller.
                    with open(inherited_marker, "w"):
                        pass
                    raise RuntimeError(_UNGUARDED_MESSAGE) from err
                processes.append(process)
    except BaseException:
        _end(processes)
        raise
    return processes


def _unpickled_main(job: str, unpickling: str, hookless_tensors: bool) -> None:
    """In a started process: the target and its arguments, pickled by the caller into the file
    ``job`` (this process's own link to it, removed once read), then run. If they cannot be
    rebuilt here, the error goes to the file ``unpickling`` for the caller to raise."""
    try:
        with open(job, "rb") as f:
            data = io.BytesIO(f.read())
        os.remove(job)
        target, args = (_JobUnpickler(data) if hookless_tensors else pickle.Unpickler(data)).load()
        del data
    except Exception as err:  # noqa: BLE001 - told to the caller, which raises it with what to do
        with contextlib.suppress(OSError), open(unpickling, "x") as f:
            f.write(f"{type(err).__name__}: {err}")
        raise
    target(*args)


class _JobUnpickler(pickle.Unpickler):
    """pickle's unpickler, except that tensors come back without the backward hooks that torch's
    rebuild gives each of them. torch never pickles hooks: every tensor carries an empty dict of
    them, and setting even that one gives the tensor autograd state and, where it has a gradient,
    a hook called in every backward. Rebuilt as is, each parameter called into Python in every
    backward pass, and every view of a dataset's tensors (each sample a DataLoader indexes) took
    autograd's slower path, for the whole run; the caller's own tensors have neither.

    Used for the native strategies' processes. Not for the CPU runtime's thread replicas: there
    the hooks' calls into Python (each taking the GIL) happen to keep the replica threads' backward
    passes from running at once, and without them XLA's CPU runtime crashed the process in the
    GAN ``xla_ddp`` test (manual optimization, three runs of three under the suite's load)."""

    _REBUILDS = ("_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state")

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if module == "torch._utils" and name in self._REBUILDS:
            return _without_hooks(found)
        return found


def _without_hooks(rebuild: Callable[..., Any]) -> Callable[..., Any]:
    """``rebuild`` (one of torch's), its tensor's empty dict of backward hooks taken off again."""

    def rebuilt(*args: Any) -> Any:
        import torch

        tensor = rebuild(*args)
        hooks = tensor._backward_hooks
        if hooks is None or len(hooks) or type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            return tensor  # hooks someone pickled on purpose, or a subclass: as torch rebuilt it
        if type(tensor) is torch.Tensor and not tensor.requires_grad:
            return tensor.detach()  # the same data, without autograd state (a dataset's tensor)
        tensor._backward_hooks = None  # it needs autograd state; the hook goes
        return tensor

    return rebuilt


def _join_all(processes: list) -> int:
    """Wait for every process; once one fails, end the others. The first failure's exit code."""
    failed = 0
    running = list(processes)
    while running:
        # Asleep until one of them ends (no polling: a caller that woke every few milliseconds would
        # take cores and caches from the training processes). Signals still reach their handlers.
        ended = multiprocessing.connection.wait([process.sentinel for process in running])
        for process in [process for process in running if process.sentinel in ended]:
            process.join()
            running.remove(process)
            if process.exitcode != 0 and not failed:
                failed = process.exitcode
                _end(running, grace=5.0)  # they may wait for it in a collective: end them
    return failed


def _end(processes: list, grace: float = 0.0, patience: float = 10.0) -> None:
    """Terminate ``processes`` (after ``grace`` seconds to end by themselves), then reap them
    (SIGKILL for those still there ``patience`` seconds after SIGTERM)."""
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.ended_by_caller = True
            process.terminate()
    for process in processes:
        process.join(timeout=patience)
        if process.is_alive():
            process.kill()
            process.join()


def killed_by_signal(codes: list[int | None]) -> tuple[int, int] | None:
    """The first process (its index and the signal) that a signal ended which neither the
    caller's ending of the others nor a stop forwarded to them sends (SIGTERM, SIGINT): killed
    from outside (SIGKILL: the out-of-memory killer, a scheduler) or crashed (SIGSEGV, SIGABRT).
    None if there is none."""
    for index, code in enumerate(codes):
        if code is not None and code < 0 and -code not in (signal.SIGTERM, signal.SIGINT):
            return index, -code
    return None


def end_now(code: int) -> None:
    """End this process with ``code`` at once, its output flushed: no interpreter teardown (a
    replica whose peers may wait for it in a collective, or whose work is all written)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _child_main(target: Callable[..., None], args: tuple, parent: int) -> None:
    """A started replicas' process: it ends with its caller, and stops gracefully on the stop
    signals its caller forwards."""
    interrupts.become_child(parent)
    with interrupts.graceful(announce=False):
        target(*args)


#: Where ``free_port`` looks: above the registered services most hosts run, below the kernel's
#: ephemeral range (Linux starts it at 32768 by default, macOS and Windows at 49152).
_PORTS_FROM = 20000
#: torch's default rendezvous (torchrun) and master ports: a job started by hand takes them unasked.
_TORCH_DEFAULT_PORTS = range(29400, 29600)


def _ephemeral_ports_start() -> int:
    """The lowest port the kernel hands out by itself (Linux's ``ip_local_port_range``; 32768,
    the lowest default of the common kernels, where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on this host now, for a server that a process about to start will open
    (a rendezvous store, a profiler).

    Drawn at random below the kernel's ephemeral range, and checked by binding it. A port the
    kernel picks itself (``bind(("", 0))``) is free only until it hands the same port to the next
    program asking for any port, such as another launcher's store: the processes started here
    would then join that store as clients and fail when it goes. Below that range only a program
    asking for that very port takes it. Where the range starts too low to leave room, the kernel
    picks."""
    import random
    import socket

    start = _ephemeral_ports_start()
    draw = random.SystemRandom()
    for _ in range(100 if start - _PORTS_FROM >= 1000 else 0):
        port = draw.randrange(_PORTS_FROM, start)
        if port in _TORCH_DEFAULT_PORTS:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # where a store listens: every interface
            except OSError:  # in use, or closing (TIME_WAIT)
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

