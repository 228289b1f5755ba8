"""``XModule``: the user's model, steps and optimizers, with Lightning's hook names."""

from __future__ import annotations

import abc
import argparse
import contextlib
import copy
import inspect
import os
import types
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import nn

from xtrainer.loop.optimizers import step_scheduler
from xtrainer.trainer_view import TrainerView


class AttributeDict(dict):
    """``hparams``: a dict whose keys read as attributes too (``self.hparams.lr``)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"hparams has no {key!r} (it holds {sorted(self)}).") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        del self[key]


class HyperparametersMixin:
    """``save_hyperparameters`` and ``hparams``, shared by ``XModule`` and ``XDataModule``."""

    _hparams: AttributeDict
    _hparams_name: str | None = None  # the __init__ argument that held them whole, if one did
    _log_hyperparams: bool = True

    @property
    def hparams(self) -> AttributeDict:
        if "_hparams" not in self.__dict__:
            object.__setattr__(self, "_hparams", AttributeDict())
        return self._hparams

    @property
    def hparams_initial(self) -> AttributeDict:
        """The hyperparameters as they were when saved (later edits of ``hparams`` not included)."""
        return copy.deepcopy(self.__dict__.get("_hparams_initial", AttributeDict()))

    def save_hyperparameters(self, *args: Any, ignore: Sequence[str] | str | None = None,
                             frame: types.FrameType | None = None, logger: bool = True, **hparams: Any) -> None:
        """Record hyperparameters: written into checkpoints (``load_from_checkpoint`` rebuilds
        the module from them) and to the loggers (unless ``logger=False``).

        As in Lightning: with no arguments, every argument of the calling ``__init__`` (and of
        the ``__init__`` methods of subclasses that called it); with names, those arguments only; with
        one dict, ``Namespace`` or OmegaConf config, that object. ``ignore`` leaves names out.
        Keyword arguments record those values directly (``save_hyperparameters(lr=0.1)``).
        Modules passed to ``__init__`` are left out with a warning: their weights are in the
        checkpoint already, and a checkpoint holds data, never objects.
        """
        ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
        if frame is None:
            frame = inspect.currentframe().f_back
        init_args = _init_arguments(frame, self)
        chosen: dict[str, Any] = {}
        if not args and not hparams:
            chosen = init_args
        for arg in args:
            if isinstance(arg, str):
                if arg not in init_args:
                    raise ValueError(f"save_hyperparameters({arg!r}): {arg!r} is not an argument of "
                                     f"{type(self).__name__}.__init__ (its arguments: {sorted(init_args)}).")
                chosen[arg] = init_args[arg]
            elif isinstance(arg, (Mapping, argparse.Namespace)) or _is_omegaconf(arg):
                whole = vars(arg) if isinstance(arg, argparse.Namespace) else arg
                if len(args) == 1 and not hparams:
                    self._hparams_name = next((n for n, v in init_args.items() if v is arg), None)
                if _is_omegaconf(whole):
                    from omegaconf import OmegaConf

                    whole = OmegaConf.to_container(whole, resolve=True)
                chosen.update(whole)
            else:
                raise TypeError(f"save_hyperparameters() takes argument names, a dict, a Namespace or an OmegaConf "
                                f"config; got {type(arg).__name__}.")
        chosen.update(hparams)
        for name in sorted(chosen):
            if name in ignored:
                del chosen[name]
            elif isinstance(chosen[name], nn.Module):
                rank_zero_warn(f"save_hyperparameters: {name!r} is a {type(chosen[name]).__name__} module and is left "
                               f"out (its weights are in the checkpoint); pass ignore=[{name!r}] to say so.")
                del chosen[name]
        self.hparams.update(chosen)
        object.__setattr__(self, "_hparams_initial", copy.deepcopy(AttributeDict(self.hparams)))
        self._log_hyperparams = logger


def _is_omegaconf(value: Any) -> bool:
    try:
        from omegaconf import Container
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        return False
    return isinstance(value, Container)


def _init_arguments(frame: types.FrameType | None, obj: Any) -> dict[str, Any]:
    """The arguments of the ``__init__`` running in ``frame`` for ``obj``, with those of the
    ``__init__`` methods that called it through ``super().__init__`` (the innermost's values win)."""
    chain = []
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is obj:
        chain.append(frame)
        frame = frame.f_back
    collected: dict[str, Any] = {}
    for init in reversed(chain):
        code, local = init.f_code, init.f_locals
        count = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[1:count])
        varargs = bool(code.co_flags & inspect.CO_VARARGS)
        if code.co_flags & inspect.CO_VARKEYWORDS:
            collected.update(local.get(code.co_varnames[count + varargs], {}))
        collected.update({name: local[name] for name in names if name in local})
    collected.pop("__class__", None)
    return collected


class BatchTransferHooks:
    """Lightning's three batch-transfer hooks, on ``XModule`` and ``XDataModule`` alike: a batch
    drawn from a loader goes through ``on_before_batch_transfer``, ``transfer_batch_to_device``
    and ``on_after_batch_transfer``, in the training process, before ``on_*_batch_start`` and the
    step. Where a data module overrides one, its own is called instead of the module's (as in
    Lightning). On the native strategies the first hook sees the batch on the host; on the XLA
    strategies batches travel in torch_xla's loader, ahead of the step, so it sees them on the
    device already and the move is a no-op (as in Lightning on TPUs). Where neither overrides any,
    none is called and batches move as they always do."""

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Alter a batch before it moves to the device; return it."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move ``batch`` to ``device``: every tensor in it (in lists, tuples, dicts, dataclasses),
        and any other object with a ``to(device)`` method; return it."""
        return move_data_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Alter a batch once it is on the device (augment, normalize there); return it."""
        return batch


def move_data_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor (and every object with a ``to`` method) moved to ``device``
    (non-blocking copies where the device is not the CPU)."""
    blocking = torch.device(device).type == "cpu"

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=not blocking)
        moved = value.to(device)
        return value if moved is None else moved  # a to() that moves in place returns None

    return apply_to_collection(batch, (torch.Tensor, _Movable), move)


class _Movable(abc.ABC):
    """Any class with a ``to`` method (a batch class of the user's), for ``apply_to_collection``."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        return callable(getattr(subclass, "to", None)) or NotImplemented


class class_only:
    """A classmethod that refuses a call on an instance, as Lightning's ``load_from_checkpoint``
    does: ``model.load_from_checkpoint(path)`` returns a new module and leaves ``model`` as it
    was, which a script that does not assign the result takes for loaded weights."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self.method = method
        self.__doc__ = method.__doc__
        signature = inspect.signature(method)  # as a classmethod shows it: without cls
        self.signature = signature.replace(parameters=list(signature.parameters.values())[1:])

    def __get__(self, instance: Any, owner: type) -> Callable[..., Any]:
        method = self.method

        def bound(*args: Any, **kwargs: Any) -> Any:
            if instance is not None:
                raise TypeError(f"{owner.__name__}.{method.__name__} is called on the class, and returns a new "
                                f"object: `model = {owner.__name__}.{method.__name__}(path)`. Called on an instance, "
                                "it would leave that instance as it was.")
            return method(owner, *args, **kwargs)

        bound.__name__, bound.__qualname__, bound.__doc__ = method.__name__, method.__qualname__, method.__doc__
        bound.__signature__ = self.signature  # type: ignore[attr-defined]
        return bound


class _Detached(RuntimeError):
    """``XModule.trainer`` read where no Trainer is attached."""


class XModule(BatchTransferHooks, HyperparametersMixin, nn.Module):
    """Subclass this instead of ``lightning.LightningModule``; the hook names are the same.

    Required: ``training_step`` and ``configure_optimizers``. Everything else is optional.
    Inside the steps, ``self.log`` records values on the device; they are read back to the host
    only every ``log_every_n_steps`` optimizer steps and at the end of an epoch.
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer: TrainerView | None = None

    # ---- what the Trainer provides -------------------------------------------------------
    @property
    def trainer(self) -> "TrainerView":
        if self._trainer is None:
            raise _Detached(f"{type(self).__name__} is not attached to a Trainer yet.")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: "TrainerView | None") -> None:
        self._trainer = trainer

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        if self._trainer is not None:
            return self._trainer.strategy.device
        return torch.device("cpu")

    #: The mesh the strategy runs over while a stage runs (``ModelParallelStrategy``'s), else None.
    _device_mesh: Any = None

    @property
    def device_mesh(self) -> Any:
        """The 2-D ``DeviceMesh`` (``("data_parallel", "tensor_parallel")``) that
        ``ModelParallelStrategy`` runs over, to parallelize the module with in ``configure_model()``
        (``parallelize_module(..., self.device_mesh["tensor_parallel"])``, ``fully_shard(...,
        mesh=self.device_mesh["data_parallel"])``), as in Lightning; None under other strategies
        and outside a stage."""
        return self._device_mesh

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the module's floating-point parameters (Lightning's ``self.dtype``), or
        torch's default where it has none."""
        for tensor in self.parameters():
            if tensor.is_floating_point():
                return tensor.dtype
        return torch.get_default_dtype()

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        return self._trainer.local_rank if self._trainer is not None else 0

    @property
    def logger(self) -> Any:
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        return self._trainer.loggers if self._trainer is not None else []

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every replica's ``data`` (tensors, or a collection of them), stacked on a new first
        dimension of size ``world_size``, inside the graph (no host sync). One replica: the data
        as it is, without that dimension, as in Lightning. ``sync_grads=True``: the gradient flows
        back to every replica's own part (the native strategies; refused on XLA's replicas)."""
        if group is not None:
            raise ValueError("self.all_gather(group=...) is not supported: it gathers over every replica.")
        return self.trainer.strategy.all_gather(data, sync_grads=sync_grads)

    @class_only
    def load_from_checkpoint(cls, checkpoint_path: str | os.PathLike, map_location: Any = None,
                             hparams_file: str | os.PathLike | None = None, strict: bool = True,
                             **kwargs: Any) -> "XModule":
        """A new module built from the hyperparameters a checkpoint recorded (``kwargs``
        override them), holding its weights. Any layout: a whole file, or a sharded folder
        (``xla_fsdp``, ``xla_fsdp2``/SPMD), whose shards are assembled. The file is read
        weights-only and checked against its checksums: nothing in it runs. As in Lightning, the
        module's ``configure_model`` and ``on_load_checkpoint`` run before the weights are loaded."""
        from xtrainer.checkpoint import read_module

        hparams, name, checkpoint = read_module(checkpoint_path)
        if hparams_file is not None:
            from omegaconf import OmegaConf

            hparams = OmegaConf.to_container(OmegaConf.load(os.fspath(hparams_file)), resolve=True)
        hparams = {**hparams, **kwargs}
        # As Lightning builds it: the hyperparameters as the one argument that held them, else as
        # keyword arguments (those __init__ does not take left out, unless it takes **kwargs).
        parameters = inspect.signature(cls.__init__).parameters
        if name not in parameters or parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            name = None
        if not name and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            hparams = {k: v for k, v in hparams.items() if k in parameters and k != "self"}
        if not name:
            missing = [k for k, p in parameters.items() if k != "self" and k not in hparams and p.default is p.empty
                       and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            if missing:
                raise TypeError(f"{cls.__name__}.load_from_checkpoint: the checkpoint's hyperparameters hold no value for "
                                f"{', '.join(missing)} (an argument save_hyperparameters left out: an nn.Module, or "
                                f"one in ignore=). Give it: {cls.__name__}.load_from_checkpoint(path, "
                                f"{', '.join(f'{k}=...' for k in missing)}).")
        model = cls(**{name: hparams}) if name else cls(**hparams)
        # Lightning's order: the layers configure_model builds, then on_load_checkpoint, then the weights.
        try:
            model.configure_model()
        except _Detached as err:  # it wraps with the trainer's strategy (xla_fsdp's recipe): no trainer here
            rank_zero_warn(f"load_from_checkpoint: {type(model).__name__}.configure_model() needs a Trainer ({err}); "
                           "it was skipped, and the weights load into the layers __init__ built.")
        model.on_load_checkpoint(checkpoint)
        missing, unexpected = model.load_state_dict(checkpoint["state_dict"], strict=strict)
        if missing or unexpected:
            rank_zero_warn(f"load_from_checkpoint({os.fspath(checkpoint_path)!r}, strict=False): missing keys "
                           f"{missing}, unexpected keys {unexpected}.")
        if isinstance(map_location, (str, torch.device)):
            model = model.to(map_location)
        return model

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer is not part of the module: a module pickled for a replica, or deep-copied,
        # travels without it and is attached to that replica's Trainer there.
        state = self.__dict__.copy()
        state["_trainer"] = None
        return state

    # ---- manual optimization ------------------------------------------------------------------
    @property
    def automatic_optimization(self) -> bool:
        """True (default): the Trainer runs backward and steps the one optimizer. Set it to
        False in ``__init__`` to do both in ``training_step`` (``self.optimizers()``,
        ``self.manual_backward(loss)``, ``opt.step()``): GANs, several optimizers, custom loops."""
        return self.__dict__.get("_automatic_optimization", True)

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self.__dict__["_automatic_optimization"] = bool(value)

    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizers (one, or a list of several) wrapped so that ``step()`` reduces gradients
        across replicas as the strategy needs; ``use_pl_optimizer=False``: the plain ones."""
        trainer = self.trainer
        found = trainer.run.optim.manual_optimizers if use_pl_optimizer else trainer.optimizers
        return found[0] if len(found) == 1 else list(found)

    def lr_schedulers(self) -> Any:
        """The schedulers (None, one, or a list). Under manual optimization, step them yourself."""
        found = self.trainer.lr_schedulers
        return None if not found else found[0] if len(found) == 1 else found

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``loss.backward()`` as the strategy needs it (DDP's reducer is re-armed for each
        backward of a step), between the ``on_before_backward``/``on_after_backward`` hooks."""
        self.trainer.manual_backward(loss, *args, **kwargs)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The backward pass of ``loss`` (``loss.backward()``), in the strategy's backward and in
        ``manual_backward``: override it to change how backward runs, as in Lightning."""
        loss.backward(*args, **kwargs)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clips the gradients before each optimizer step under automatic optimization, with the
        Trainer's ``gradient_clip_val``/``gradient_clip_algorithm``: override it to clip otherwise
        (``self.clip_gradients(optimizer, ...)``), as in Lightning."""
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Steps one scheduler where its interval is due (``metric``: a ``ReduceLROnPlateau``'s
        monitored value, else None): override it for a scheduler with another ``step`` signature
        (timm's, say), as in Lightning."""
        step_scheduler(scheduler, metric)

    # ---- the evaluation loops' model modes (Lightning's, module-only hooks) ----------------------
    def on_validation_model_eval(self) -> None:
        """Puts the model in eval mode as a validation starts; override to keep parts training."""
        self.trainer.model.eval()

    def on_validation_model_train(self) -> None:
        """Puts the model back in training mode after a fit's validation."""
        self.trainer.model.train()

    def on_validation_model_zero_grad(self) -> None:
        """Called before a fit's validation. The Trainer keeps the step's gradients through it
        (Lightning's default drops them here); a module that overrides it to keep them, or to do
        something else there, runs as in Lightning."""

    def on_test_model_eval(self) -> None:
        """Puts the model in eval mode as a test starts."""
        self.trainer.model.eval()

    def on_test_model_train(self) -> None:
        """Puts the model back in training mode after a test that ran during a fit."""
        self.trainer.model.train()

    def on_predict_model_eval(self) -> None:
        """Puts the model in eval mode as a prediction starts."""
        self.trainer.model.eval()

    @property
    def on_gpu(self) -> bool:
        """Whether the module's parameters are on a CUDA device (Lightning's property)."""
        return self.device.type == "cuda"

    def clip_gradients(self, optimizer: Any, gradient_clip_val: float | None = None,
                       gradient_clip_algorithm: str | None = None) -> None:
        """Clip ``optimizer``'s gradients by ``"norm"`` (default) or ``"value"``. Applied to the
        reduced gradients, right before that optimizer's next ``step()``."""
        self.trainer.clip_gradients_of(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Only ``optimizer``'s parameters require gradients until ``untoggle_optimizer``: the
        other optimizers' parameters are switched off (their settings are kept to restore)."""
        raw = getattr(optimizer, "optimizer", optimizer)
        mine = {id(p) for group in raw.param_groups for p in group["params"]}
        saved = self.__dict__.setdefault("_toggled", {})
        for other in self.trainer.optimizers:
            for group in other.param_groups:
                for param in group["params"]:
                    if id(param) not in mine and param not in saved:
                        saved[param] = param.requires_grad
                        param.requires_grad = False
        self.trainer.strategy.requires_grad_changed(self.trainer.model)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        del optimizer
        for param, requires_grad in self.__dict__.pop("_toggled", {}).items():
            param.requires_grad = requires_grad
        self.trainer.strategy.requires_grad_changed(self.trainer.model)

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Any) -> Iterator[None]:
        """``toggle_optimizer(optimizer)`` for the block, ``untoggle_optimizer`` after it (also
        when it raises): ``with self.toggled_optimizer(opt_g): ...``."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def freeze(self) -> None:
        """No gradients for any parameter, and evaluation mode."""
        for param in self.parameters():
            param.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        for param in self.parameters():
            param.requires_grad = True
        self.train()

    # ---- logging ---------------------------------------------------------------------------
    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool = True, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce_fx: str | Callable = "mean", enable_graph: bool = False,
            sync_dist: bool = False, sync_dist_group: Any = None, add_dataloader_idx: bool = True,
            batch_size: int | None = None, metric_attribute: str | None = None, rank_zero_only: bool = False
            ) -> None:
        """Record a scalar. Defaults, as in Lightning: per step in a training batch (``training_step``
        and the hooks from ``on_train_batch_start`` to ``on_train_batch_end``: a value logged after
        the optimizer step, in ``on_train_batch_end``, reaches the loggers at the next logging step),
        per epoch elsewhere (evaluation batches, their hooks: a mean; epoch hooks, ``on_train_start``).

        ``value`` stays on the device. ``reduce_fx`` (``"mean"``, weighted by batch size, or
        ``"sum"``, ``"max"``, ``"min"``, or ``torch.mean``/``sum``/``max``/``min``) combines the
        values of an epoch; ``sync_dist=True`` also combines them across replicas, inside the
        graph. ``logger=False`` keeps the value from the loggers (callbacks and the progress bar
        still see it). ``add_dataloader_idx=False`` leaves out the ``/dataloader_idx_N`` suffix.
        ``rank_zero_only`` and ``enable_graph`` change nothing here: loggers are written by rank 0
        only, and logged values are always detached.
        """
        del enable_graph, metric_attribute, rank_zero_only
        if sync_dist_group is not None:
            raise ValueError(f"self.log({name!r}, sync_dist_group=...) is not supported: sync_dist reduces over "
                             "every replica.")
        if self._trainer is None:  # a *_step called alone (a unit test of the module): warned, as in Lightning
            rank_zero_warn(f"self.log({name!r}): {type(self).__name__} is not attached to a Trainer; the value is "
                           "dropped (pass the module to Trainer.fit to log).")
            return
        self._trainer.run.results.log(name, value, on_step, on_epoch, prog_bar, sync_dist, reduce_fx, batch_size, logger,
                             add_dataloader_idx)

    def log_dict(self, values: Mapping[str, Any], **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value, **kwargs)

    # ---- the steps ---------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not define training_step(self, batch, batch_idx); "
            "it must return the loss tensor or a dict with a 'loss' entry."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define validation_step(self, batch, batch_idx).")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define test_step(self, batch, batch_idx).")

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Default, as in Lightning: ``self(batch)``, the whole batch as the loader gives it (an
        ``(inputs, target)`` pair too: a module whose ``forward`` takes the inputs alone defines its
        own ``predict_step``)."""
        batch = kwargs.get("batch", args[0] if args else None)
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} does not define configure_optimizers(). Return an optimizer, "
            "(optimizers, schedulers), or {'optimizer': ..., 'lr_scheduler': ...}."
        )

    def configure_model(self) -> None:
        """Build (and, under ``xla_fsdp``, wrap) submodules once the strategy is set up."""

    def configure_callbacks(self) -> Any:
        """Callbacks this module needs (one or a list). They join the Trainer's; one of the same
        type given to the Trainer is replaced, as in Lightning."""
        return []

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Step the optimizer. Override to change the step (a warm-up of the learning rate, say):
        ``optimizer`` is the Trainer's wrapper, whose ``step(closure=optimizer_closure)`` reduces
        gradients across replicas, clips them and steps; ``optimizer_closure()`` returns the loss
        (the backward pass has already run: it does not run it again)."""
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)  # as the Trainer's own step clears them

    # ---- export (the trained module, on the CPU after fit) --------------------------------------
    #: An input of ``forward`` (a tensor, or a tuple or dict of its arguments): the model summary
    #: shows each layer's sizes for it, and ``to_onnx`` and ``to_torchscript(method="trace")`` use
    #: it when given none.
    example_input_array = None

    def _example_input(self, given: Any, method: str) -> Any:
        example = self.example_input_array if given is None else given
        if example is None:
            raise ValueError(f"{type(self).__name__}.{method} needs an example input: pass one, or set "
                             "self.example_input_array in __init__.")
        return move_data_to_device(example, self.device)

    @torch.no_grad()
    def to_torchscript(self, file_path: str | os.PathLike | None = None, method: str = "script",
                       example_inputs: Any = None, **kwargs: Any) -> Any:
        """The module as TorchScript (Lightning's ``to_torchscript``), in eval mode; its mode is
        restored after.

        Args:
            file_path: where to save it as well (``torch.jit.save``); None: not saved.
            method: ``"script"`` (``torch.jit.script``) or ``"trace"`` (``torch.jit.trace`` over
                ``example_inputs``, else ``example_input_array``).
            example_inputs: the inputs to trace with.
            **kwargs: passed to ``torch.jit.script`` or ``torch.jit.trace``.
        """
        if method not in ("script", "trace"):
            raise ValueError(f"to_torchscript(method={method!r}): use 'script' or 'trace'.")
        mode = self.training
        try:
            if method == "script":
                exported = torch.jit.script(self.eval(), **kwargs)
            else:
                example = self._example_input(example_inputs, "to_torchscript(method='trace')")
                exported = torch.jit.trace(self.eval(), example_inputs=example, **kwargs)
        finally:
            self.train(mode)
        if file_path is not None:
            torch.jit.save(exported, os.fspath(file_path))
        return exported

    def to_onnx(self, file_path: str | os.PathLike | Any = None, input_sample: Any = None, **kwargs: Any) -> Any:
        """Export the module to ONNX (Lightning's ``to_onnx``, through ``torch.onnx.export``), in
        eval mode; its mode is restored after. Needs the ``onnx`` package. Where ``onnxscript``
        (what torch's default exporter needs) is not installed and ``dynamo`` is not given, torch's
        TorchScript-based exporter (``dynamo=False``) runs.

        Args:
            file_path: the file (or file object) to write; None: what ``torch.onnx.export`` returns.
            input_sample: the input to export with (default: ``example_input_array``).
            **kwargs: passed to ``torch.onnx.export`` (``export_params``, ``dynamo``, ...).
        """
        import importlib.util

        if importlib.util.find_spec("onnx") is None:
            raise ModuleNotFoundError(f"{type(self).__name__}.to_onnx() needs the onnx package: pip install onnx.")
        if "dynamo" not in kwargs and importlib.util.find_spec("onnxscript") is None:
            kwargs["dynamo"] = False
        sample = self._example_input(input_sample, "to_onnx()")
        if isinstance(file_path, os.PathLike):
            file_path = os.fspath(file_path)
        mode = self.training
        try:
            return torch.onnx.export(self.eval(), sample, file_path, **kwargs)
        finally:
            self.train(mode)

    # ---- setup and teardown ---------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Download or write data once per host, in the calling process, before any replica starts."""

    def setup(self, stage: str) -> None:
        """Called in every replica at the start of ``fit``/``validate``/``test``/``predict``
        (``stage``), before the strategy wraps the module."""

    def teardown(self, stage: str) -> None:
        """Called in every replica at the end of each stage."""

    # ---- data (optional) -----------------------------------------------------------------------
    # train_dataloader(), val_dataloader(), test_dataloader(), predict_dataloader(): define any of
    # them to have the Trainer use it when fit()/validate()/... receive no loaders.

    # ---- hooks (no-ops) -----------------------------------------------------------------------
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...
    def on_exception(self, exception: BaseException) -> None: ...


#: Hooks an ``XModule`` may override, besides the ``*_step`` methods and ``configure_*``: its
#: ``on_*`` methods, each also a ``Callback`` hook of the same name (the module's runs first).
MODULE_HOOKS = frozenset(name for name, value in vars(XModule).items()
                         if name.startswith("on_") and callable(value) and "_model_" not in name)
#: The evaluation loops' model-mode hooks: the module's alone (Lightning has no callback hooks of these names).
MODEL_MODE_HOOKS = frozenset(name for name in vars(XModule) if name.startswith("on_") and "_model_" in name)


#: Properties and attributes TorchScript leaves out when it scripts a module (``to_torchscript``):
#: the Trainer's and the hyperparameters', which a scripted module has no use for.
XModule.__jit_unused_properties__ = sorted(
    {name for klass in XModule.__mro__ for name, value in vars(klass).items() if isinstance(value, property)})
XModule.__jit_ignored_attributes__ = ["_trainer", "_hparams", "_hparams_initial", "_hparams_name",
                                      "_log_hyperparams", "_automatic_optimization", "example_input_array"]
