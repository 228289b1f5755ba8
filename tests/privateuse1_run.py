"""A chipless stand-in for TorchTPU and TorchNeuron, for tests/stories/strategies/test_runtimes.py.

Registers PrivateUse1 under a name (``tpu``, ``neuron``, or any other) through torch's public
registration API (``torch.utils.rename_privateuse1_backend``, ``torch._register_device_module``,
``torch.distributed.Backend.register_backend``), with no tensors. Its device module behaves as
TorchTPU's does on torch >= 2.11: the device calls (``device_count``, ``is_available``,
``synchronize``, ``set_device``, ``current_stream``) raise ``RuntimeError`` when called from
outside PyTorch, and are answered when PyTorch's own ``torch.accelerator`` calls them. The two
``torch.accelerator`` calls that need a backend's C++ hooks (``current_device_index``,
``set_device_index``) cannot exist without a real device: they are the one thing replaced, and
every call is recorded.

Then it asks xtrainer what it selects and prints one JSON line: ``python privateuse1_run.py tpu 4``.
"""

from __future__ import annotations

import json
import sys
import types

import torch

FORBIDDEN = ("device_count", "is_available", "synchronize", "set_device", "current_stream")


def _from_pytorch() -> bool:
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller == "torch" or caller.startswith("torch.")


def register(name: str, chips: int, backend: str) -> list:
    calls: list = []
    torch.utils.rename_privateuse1_backend(name)
    module = types.ModuleType(f"fake_{name}")
    answers = {"device_count": lambda: chips, "is_available": lambda: True, "synchronize": lambda *a: None,
               "set_device": lambda *a: None, "current_stream": lambda *a: None}

    def guarded(api: str):
        def call(*args, **kwargs):
            if not _from_pytorch():
                raise RuntimeError(f"torch.{name}.{api}() is not supported from outside PyTorch; use "
                                   f"torch.accelerator.{api}()")
            calls.append(api)
            return answers[api](*args, **kwargs)
        return call

    for api in FORBIDDEN:
        setattr(module, api, guarded(api))
    module.manual_seed = lambda seed: calls.append(("manual_seed", seed))
    torch._register_device_module(name, module)
    torch.distributed.Backend.register_backend(backend, lambda *a, **k: None, devices=[name])
    # What only a real backend's C++ hooks answer (this process "sees" device 0, as each TorchTPU
    # process sees its chip).
    torch.accelerator.current_device_index = lambda: 0
    torch.accelerator.set_device_index = lambda index: calls.append(("set_device_index", index))
    return calls


def main() -> None:
    name, chips = sys.argv[1], int(sys.argv[2])
    backend = {"tpu": "tpu_dist", "neuron": "neuron"}.get(name, f"{name}ccl")
    calls = register(name, chips, backend)
    from xtrainer import Trainer
    from xtrainer.runtimes import NATIVE, EagerRuntime, select_family

    report: dict = {"family_auto": select_family("auto") == NATIVE, "family_named": select_family(name) == NATIVE}
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    runtime = trainer.strategy.runtime
    report.update(strategy=trainer.strategy.name, devices=trainer.strategy.devices, type=runtime.type,
                  backend=runtime.process_group_backend(), compile=runtime.compile_options({}),
                  compile_user=runtime.compile_options({"dynamic": True, "mode": "max-autotune"}))
    one = Trainer(accelerator=name, devices=1, logger=False, enable_checkpointing=False)
    report.update(one_strategy=one.strategy.name, one_type=one.strategy.runtime.type)
    fsdp = Trainer(strategy="fsdp", devices=2, logger=False, enable_checkpointing=False)
    report.update(fsdp=fsdp.strategy.name)
    calls.clear()
    device = EagerRuntime(name).start(local_rank=chips - 1)
    report.update(device=str(device), start_calls=[list(c) if isinstance(c, tuple) else c for c in calls])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
