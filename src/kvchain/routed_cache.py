"""`RoutedKVCache`: a model runner's per-layer route into the sub-pool views: for layer l, which
sub-pool holds its attention (and its state) and the typed tensors of that layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import LayoutError
from .layout.views import SubPoolView
from .plan import KVStoragePlan, PoolKind


@dataclass(frozen=True)
class LayerRoute:
    layer_id: int
    attention: str | None  # sub-pool name
    state: str | None


class RoutedKVCache:
    def __init__(self, plan: KVStoragePlan, views: dict[str, SubPoolView]) -> None:
        self.views = views
        routes: dict[int, dict[str, str | None]] = {}
        for pool in plan.sub_pools:
            key = "state" if pool.kind is PoolKind.STATE else "attention"
            for layer in pool.layer_ids:
                routes.setdefault(layer, {"attention": None, "state": None})[key] = pool.name
        self.routes = {lid: LayerRoute(lid, r["attention"], r["state"]) for lid, r in sorted(routes.items())}

    def route(self, layer_id: int) -> LayerRoute:
        try:
            return self.routes[layer_id]
        except KeyError:
            raise LayoutError(f"layer {layer_id} is in no sub-pool of the plan "
                              f"(layers {min(self.routes)}..{max(self.routes)})") from None

    def attention(self, layer_id: int) -> tuple[str, dict[str, torch.Tensor]]:
        """(sub-pool name, {component: [n_pages, page_size, ...] tensor}) for the layer's attention."""
        route = self.route(layer_id)
        name = route.attention
        if name is None:
            raise LayoutError(f"layer {layer_id} has no attention part (its state is in {route.state!r})")
        view = self.views[name]
        comps = {c.name: view.tensor(layer_id, c.name) for c in view.pool.envelope.components if c.layer_id == layer_id}
        return name, comps

    def state(self, layer_id: int) -> tuple[str, dict[str, torch.Tensor]]:
        route = self.route(layer_id)
        name = route.state
        if name is None:
            raise LayoutError(f"layer {layer_id} has no state part (its attention is in {route.attention!r})")
        view = self.views[name]
        comps = {c.name: view.tensor(layer_id, c.name) for c in view.pool.envelope.components if c.layer_id == layer_id}
        return name, comps
