"""The runtime of a converted model: the user's own object, whose ``forward`` runs rewritten graphs captured per call structure.

:func:`depthrewrite.convert` converts in place (as ``torchao.quantization.quantize_`` does): the model keeps its
identity, its attributes and its methods, and its class becomes a subclass of the original one
(:class:`~.classes.ConvertedModel` first in the method order) whose ``forward`` has the original signature. So ``.config``,
``generate()``, ``save_pretrained()``, HF ``Trainer`` and a hand-written model's own methods keep working.

How a call runs (:meth:`.state.ConversionState.call`):

1. **Module tree.** A fingerprint of the submodule tree (every submodule object and type, its parameters' and
   buffers' identities, its hook dicts, the config's attributes, activation-checkpointing flags) is compared with the
   one recorded at the last capture. A replaced, added or removed submodule (peft's LoRA), a hook added or removed, a
   reassigned parameter or buffer (``.to()`` replaces buffers, ``tie_weights()`` parameters) or a config change drops
   every captured graph, and the call recaptures: the module tools are followed, never bypassed. A hooked submodule
   is called as the live module (module calls, the default) or, where its call cannot be kept, its hooks are traced
   into the new graph (a warning says their side effects happen at capture only); a global module hook cannot be
   followed and is a :class:`~depthrewrite.errors.ModuleTreeChangedError`.
2. **Call structure.** The call is bound to the original signature; its structure is the training mode, the model's
   dtype and device, and per argument: ``None``, a tensor's dtype/device/rank, a Python value, or a container's
   layout (a KV cache). Each structure gets its own graphs on first use: captured with ``torch.export`` from the
   original ``forward``, rewritten by the scheme's pass, sharing the same new parameters (``model.depthrewrite``,
   sites matched by position in the chain; a structure whose chain differs is a typed error).
3. **Shapes.** Batch and sequence dimensions are dynamic. Where export fixed a dimension (or a dynamic one is 0 or 1
   in this call, which export assumes it is not), the call gets a graph of its own, as ``torch.compile`` recompiles.
4. **Caches.** A call that passes a ``transformers`` ``DynamicCache`` runs a graph that takes the cache's tensors and
   returns the new ones; they are written back into the caller's cache object, which HF models (and ``generate()``)
   expect to be updated in place.

Copies (``copy.deepcopy``, pickle, ``torch.save``) carry the module state and the conversion's recipe, never the
graphs: a copy recaptures on first use.

The modules, each importing only those above it in this list (``tests/test_import_graph.py`` checks there is no import
cycle anywhere in the package):

- :mod:`.handle`: ``is_converted`` and ``state_of``, what the graph modules, block runners and pipeline ask;
- :mod:`.entries`: call structures, :class:`~.entries.GraphEntry` (a graph and its size guards), the capture lock;
- :mod:`.tree`: the module-tree fingerprint and the hook checks and warnings;
- :mod:`.caches`: the transformers KV cache (write-back, MSAR's decoding state in extra layers), in one place;
- :mod:`.offload`: accelerate's offloaded modules, loaded around what the graphs read directly and while capturing;
- :mod:`.classes`: the converted class, and the class a model has while it is captured;
- :mod:`.rewrite`: one capture of a call, rewritten and lowered to module calls;
- :mod:`.state`: :class:`~.state.ConversionState`, which runs a call.

:func:`depthrewrite.convert` (``depthrewrite.api``) sits above all of them.
"""
