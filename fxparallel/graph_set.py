"""The graphs of one parallel module, held by one object: looked up per call (a shape seen before costs a
dictionary lookup), added when the factory captures a new one, compiled per ``CompileConfig``, and dropped
all together when the module is cast to another dtype (the captured code bakes its dtype in)."""
from __future__ import annotations

import copy
import re
from typing import Callable, Optional

import torch

from .capture.spec import GraphSpec
from .errors import InputError
from .ops.local_graph import LocalGraph

# a cache's count of tokens read on the host (capture/static_cache.py, ``_length_read_as_int``)
_COUNT_READ = re.compile(r"\bpast_\d+_cumulative_length\.item\(\)")
# the arguments whose dim 1 is the call's tokens (with a cache the attention mask spans the cache instead)
_TOKEN_ARGUMENTS = ("input_ids", "position_ids", "labels")


class GraphSet:
    def __init__(self, factory: Callable[[GraphSpec], LocalGraph]):
        self.factory = factory  # spec -> LocalGraph: captures, plans and rewrites a new graph (api.GraphFactory)
        self._graphs: list = []
        self._by_shapes: dict = {}  # (identity, argument names, shapes) -> graph: no guard evaluated per call
        self._compiled: list = []  # (compile config, graph, compiled code)
        self.last: Optional[LocalGraph] = None  # the graph of the last call (its output sizes)
        self.kept_cache = None  # (key, ParallelCache): a compiled generate's cache, reused (generation/loop.py)
        self.cache_refused = None  # the CacheNotCarried its capture raised: raised again, not captured again
        # generation without a cache: right-padded to a fixed length (the code fixes it), or grown (None: not known)
        self.recompute_padded = None
        # forwards of several tokens with a cache run one token at a time (their code fixes the count: module.py)
        self.prompt_by_token = False

    def __iter__(self):
        return iter(list(self._graphs))

    def __len__(self) -> int:
        return len(self._graphs)

    def add(self, graph: LocalGraph, shapes: Optional[dict] = None) -> None:
        """Keep ``graph``; ``shapes``: the call's it was captured for (then found without its guards)."""
        self._graphs.append(graph)
        if shapes is not None:
            self._by_shapes[self._key(graph.spec, shapes)] = graph

    @staticmethod
    def _key(spec: GraphSpec, shapes: dict) -> tuple:
        names = tuple(sorted(shapes))
        return spec.identity, names, tuple(shapes[n] for n in names)

    def with_cache_length(self, length: int) -> Optional[LocalGraph]:
        return next((g for g in self._graphs if g.cache_length == length), None)

    def find(self, spec: GraphSpec, shapes: dict) -> Optional[LocalGraph]:
        """The graph of ``spec``'s identity whose guards hold for ``shapes`` (argument name -> shape), or None."""
        key = self._key(spec, shapes)
        graph = self._by_shapes.get(key)
        if graph is None:
            graph = next((g for g in self._graphs if g.spec.identity == spec.identity and g.guards.holds_for(shapes)),
                         None)
            if graph is not None:
                self._by_shapes[key] = graph
        return graph

    def fixes_prompt_length(self, spec: GraphSpec, shapes: dict) -> bool:
        """Does a graph of ``spec``'s identity and batch hold for the prompt length it was captured at and for no
        length next to it (its guards fix the length: a graph per length, Mamba's scan, Jamba's, MiniMax's last
        block), rather than for a range of lengths (a scan over chunks padded to whole chunks)? ``shapes``: the
        call's, whose token dim is tried at the graph's length and the lengths next to it."""
        def holds(graph, tokens: int) -> bool:
            return graph.guards.holds_for({name: (shape[0], tokens) + tuple(shape[2:]) if name in _TOKEN_ARGUMENTS
                                           else shape for name, shape in shapes.items()})

        for graph in self._graphs:
            if graph.spec.identity != spec.identity or graph.spec.shape[0] != spec.shape[0]:
                continue
            length = graph.spec.shape[1]
            if holds(graph, length) and not holds(graph, length + 1) and not (length > 2 and holds(graph, length - 1)):
                return True
        return False

    def compiled(self, graph: LocalGraph, compile_config) -> Callable:
        """``graph``'s code under ``torch.compile`` with ``compile_config``'s options (compiled on its first call).
        Found by comparing configs (a dataclass), as transformers does: no copy of the options per decode step."""
        for config, compiled_graph, code in self._compiled:
            if compiled_graph is graph and config == compile_config:
                return code
        if _COUNT_READ.search(graph.code):  # (capture/static_cache.py: the count read as an int)
            raise InputError(
                "generate: compile_config is not supported for this model: its decode step reads the cache's count "
                "of tokens on the host (`.item()`: its positions or its ALiBi bias start at `cache.get_seq_length()`, "
                "as in MVP, RoFormer, TrOCR and MPT), so torch.compile would break the step into pieces around the "
                "read and compile again for every count (and CUDA graphs could not hold it); generate without "
                "compile_config")
        code = torch.compile(graph.forward, **compile_config.to_dict())
        self._compiled.append((copy.deepcopy(compile_config), graph, code))  # (the caller's may change later)
        return code

    def drop(self, factory: Callable[[GraphSpec], LocalGraph]) -> None:
        """Forget every graph, its compiled code and the kept cache; new graphs come from ``factory``."""
        self._graphs.clear()
        self._by_shapes.clear()
        self._compiled.clear()
        self.last, self.kept_cache, self.factory = None, None, factory
