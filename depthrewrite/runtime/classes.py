"""The converted model's class: :class:`ConvertedModel` first in the original class's method order, a ``forward``
with the original signature, and the class a model has while it is captured (:func:`as_original`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect as _inspect
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import torch.fx as fx
import torch.nn as nn

from ..saving import save_pretrained
from .entries import LOCK, traced_call
from .handle import ConvertedBase, state_of

if TYPE_CHECKING:
    from .state import ConversionState


@contextlib.contextmanager
def as_original(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its original class (for capture): the class and the root's own hooks are put back after."""
    st = state_of(model)
    cls = type(model)
    hooks = {a: getattr(model, a) for a in (
        "_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
    ) if hasattr(model, a)}
    own_forward = model.__dict__.pop("forward", None)  # accelerate's hook wraps forward on the instance
    model.__class__ = _capture_class(st.original)
    for a in hooks:
        setattr(model, a, OrderedDict())
    model.__dict__[_CAPTURING] = threading.get_ident()
    try:
        yield model
    finally:
        model.__dict__.pop(_CAPTURING, None)
        model.__class__ = cls
        for a, v in hooks.items():
            setattr(model, a, v)
        if own_forward is not None:
            model.__dict__["forward"] = own_forward


# ---- the class ----------------------------------------------------------------------------------------------------


def _report_of(st: ConversionState):
    """:meth:`ConvertedModel.report` (under the graph mutex)."""
    notes = st.report.notes
    if st.blocks is None and st.blocks_note:
        notes += (f"blocks are not called as modules (FSDP2 per block, checkpointing and compile per block do not "
                  f"apply): {st.blocks_note}",)
    if st.recaptures:
        notes += (f"the module tree changed {st.recaptures} time(s) since conversion (a replaced submodule, a hook, "
                  f"peft, .to(), a config attribute): every graph was dropped and recaptured; {st.captures} "
                  "captured in all",)
    return dataclasses.replace(st.report, notes=notes, blocks=st.block_infos, graphs=tuple(
        (e.structure, e.seconds, e.calls) for e in st.entries()
    ))


class ConvertedModel(ConvertedBase):
    """What a converted model's class adds to the original class (``type(model).__mro__`` is ``(Converted,
    ConvertedModel, Original, ...)``; the class keeps the original's name and gets its ``forward`` from
    :func:`converted_class`)."""

    def __call__(self, *args, **kwargs):
        # shared hold of the capture lock around the whole call, before nn.Module.__call__ (which a capture in another
        # thread may have patched): calls run concurrently, never during another thread's capture (_CaptureLock)
        if traced_call(args, kwargs):
            return super().__call__(*args, **kwargs)
        with LOCK.shared():
            return super().__call__(*args, **kwargs)

    # -- inspection

    def report(self):
        """The :class:`~depthrewrite.views.report.ConvertReport` of this conversion, with the graphs captured so far."""
        st = state_of(self)
        with LOCK.mutex:  # another thread may be adding a graph
            return _report_of(st)

    def graph_module(self, training: bool | None = None) -> fx.GraphModule:
        """The converted graph module the last call in ``training`` mode (default: the current mode) ran; the one
        captured at conversion before any call. Captures one from the example inputs when there is none in that
        mode yet."""
        st = state_of(self)
        mode = bool(self.training if training is None else training)
        with LOCK.mutex:  # another thread may be adding a graph
            entry = st.last.get(mode)
            if entry is None:
                entry = next((e for k, es in st.graphs.items() if k[0] == mode for e in list(es)), None)
        if entry is None:
            was = self.training
            try:
                self.train(mode)
                args, kwargs = st.example
                entry, _, _ = st.select(self, args, kwargs)
            finally:
                self.train(was)
        return entry.module

    @property
    def graph(self) -> fx.Graph:
        """The rewritten graph of the current mode (see :meth:`graph_module`)."""
        return self.graph_module().graph

    @property
    def graphs(self) -> Mapping[bool, fx.Graph]:
        """``{True: training graph, False: eval graph}`` of the example call structure (captured when missing)."""
        return {mode: self.graph_module(mode).graph for mode in (True, False)}

    @property
    def pipeline_cuts(self) -> tuple[int, ...] | None:
        return self.graph_module().pipeline_cuts

    # -- re-initialisation

    def to_empty(self, *, device, recurse: bool = True):
        """``nn.Module.to_empty``, then the new parameters (``model.depthrewrite``) back to their init. ``to_empty``
        leaves every parameter uninitialised for the caller's init routine to fill, and the frameworks' routines only
        know their own modules (torchtitan's ``init_states`` initialises torchtitan modules, OLMo-core's
        ``init_weights`` calls ``reset_parameters`` where a module has one): the new parameters would stay garbage
        memory. At their init the converted model is again the original function of whatever weights that routine
        writes."""
        out = super().to_empty(device=device, recurse=recurse)
        new = self._modules.get("depthrewrite")
        if new is not None:
            for m in new.modules():
                if m is not new and callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        return out

    # -- save and load

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save the model (its own ``save_pretrained`` for a Hugging Face model, else ``model.safetensors`` of the
        state dict) plus ``depthrewrite.json`` (scheme, config, version, original class); load it with
        :func:`depthrewrite.from_pretrained`."""
        return save_pretrained(self, save_directory, *args, **kwargs)

    # -- copies

    def __reduce_ex__(self, protocol):
        # the converted class is made per original class at run time: rebuild it, then nn.Module.__setstate__
        # (nn.Module.__getstate__: without a compiled call, which would run the original's modules)
        return _new_converted, (state_of(self).original,), self.__getstate__()

    def __deepcopy__(self, memo):
        out = _new_converted(state_of(self).original)
        memo[id(self)] = out
        out.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        return out

    def __repr__(self) -> str:
        st = self.__dict__.get("_depthrewrite")
        text = super().__repr__()
        if st is None:
            return text
        return f"{text}\n(converted by depthrewrite: {st.config.describe(getattr(st.report, 'block_size', None))}, " \
               f"{len(st.entries())} graph(s) captured)"


_CLASSES: dict[type, type] = {}


def converted_class(original: type) -> type:
    """The converted class of ``original``: a subclass with :class:`ConvertedModel` first, the original's name and
    module, and a ``forward`` with the original signature (HF ``generate()``, ``Trainer`` and peft read it)."""
    cls = _CLASSES.get(original)
    if cls is not None:
        return cls

    def forward(self, *args, **kwargs):
        return state_of(self).call(self, args, kwargs)

    cls = _subclass(original, (ConvertedModel, original), forward)
    _CLASSES[original] = cls
    return cls


def _subclass(original: type, bases: tuple, forward: Any, **attrs: Any) -> type:
    """A class with ``bases``, ``original``'s name, module and docs, and ``forward`` with the original signature."""
    try:
        forward.__signature__ = _inspect.signature(original.forward)
    except (TypeError, ValueError):
        pass
    forward.__doc__ = original.forward.__doc__
    forward.__qualname__ = f"{original.__qualname__}.forward"
    return type(original.__name__, bases, {
        "forward": forward, "__module__": original.__module__, "__qualname__": original.__qualname__,
        "__doc__": original.__doc__, **attrs,
    })


_CAPTURE_CLASSES: dict[type, type] = {}
# set in a model's __dict__ while it is captured (as_original): the capturing thread. In __dict__, not by identity:
# export's tracer calls modules through proxy objects of another identity that share the module's __dict__
_CAPTURING = "_depthrewrite_capturing"


def _capture_class(original: type) -> type:
    """The class a converted model has while it is captured (:func:`as_original`): the original class, except that
    ``forward`` runs the original forward only in the capturing thread. A call from another thread meanwhile (the
    class is the object's, not the thread's) goes to the converted forward, which waits for the capture to end
    (:class:`_CaptureLock`)."""
    cls = _CAPTURE_CLASSES.get(original)
    if cls is not None:
        return cls

    def forward(self, *args, **kwargs):
        if self.__dict__.get(_CAPTURING) == threading.get_ident():
            return original.forward(self, *args, **kwargs)
        return state_of(self).call(self, args, kwargs)

    def __call__(self, *args, **kwargs):
        if self.__dict__.get(_CAPTURING) == threading.get_ident():
            return nn.Module.__call__(self, *args, **kwargs)
        with LOCK.shared():  # another thread: wait until the capture is over and the class is back, then call again
            pass
        return self(*args, **kwargs)

    cls = _subclass(original, (original,), forward, __call__=__call__)
    _CAPTURE_CLASSES[original] = cls
    return cls


def _new_converted(original: type) -> nn.Module:
    """An empty instance of ``original``'s converted class: what unpickling and deepcopy make first."""
    return object.__new__(converted_class(original))
