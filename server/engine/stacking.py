"""Heterogeneous stacking: many elements (patches) on one parameter space, as numpy arrays.

Elements that share channels, bins, POI and interpolation codes (equal ``stack_key``) stack
into one model whatever their parameters: the stack's parameters are the union of the
elements' (first appearance first, so a lone element keeps pyhf's order), and a parameter an
element does not have is held fixed at its start value in that element's rows, with no
constraint term (``aux_present`` masks it) and no effect on its rates.

Sample variants (distinct samples over all elements, in the union's parameter numbering) are
split in two blocks:

- *common* variants, which every element sums (backgrounds): evaluated once per row for all
  elements, as one matrix product; ``membership [E, U]`` counts them per element;
- *element* variants (signals, patched samples): each element's own ones, padded to ``S`` slots
  per element, gathered per row, so that a row costs the same whatever the number of elements.

Example:
    >>> import pyhf
    >>> from pyhf_gpu_server.engine.layout import read_model
    >>> spec = pyhf.simplemodels.uncorrelated_background([5.0], [10.0], [2.5]).spec
    >>> model = pyhf.Model(spec)
    >>> element = read_model(model, [12.0, *model.config.auxdata])
    >>> stack = StackLayout([element, element])
    >>> stack.par_names, stack.n_common, stack.n_slots
    (['mu', 'uncorr_bkguncrt[0]'], 2, 0)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import IncompatibleModelsError
from .interpolation import KINKED_CODES, histosys_slopes_at_nominal
from .layout import ElementLayout, ParameterSet, SampleLayout, offsets


@dataclass(frozen=True)
class VariantBlock:
    """Numbers of some sample variants over ``N`` main bins, in the stack's numbering.

    Flattened columns ``q = slot * N + bin``. Parameter index ``n_pars`` in
    ``multiplier_params`` means "times 1" (padding).
    """

    nominal: np.ndarray  # [..., Q]
    histosys_params: np.ndarray  # [J] parameter index of each histosys parameter of the block
    histosys: np.ndarray  # [..., K * J, Q]
    normsys_param: np.ndarray  # [..., T] parameter index
    normsys_column: np.ndarray  # [..., T]
    normsys_coefficients: np.ndarray  # [8, ..., T]
    multiplier_params: np.ndarray  # [..., M, Q]


@dataclass(frozen=True)
class StackBudget:
    """What one stacked model may grow to: its union's parameters, and the bytes of its
    remapped sample variants' histosys arrays (``8 K J N`` each: every distinct sample over
    the union's ``J`` histosys parameters and ``N`` bins). Patches that each bring their own
    modifiers stack into a model with the union of them all; a budget splits them instead."""

    max_parameters: int
    max_variant_bytes: int

    def parameters_for(self, largest_member: int) -> int:
        """The union's parameters at most, for a group whose largest member has
        ``largest_member``: within ``max_parameters``, and at most twice that (+ 16): a fit's
        cost grows faster than its parameters, so members that share few parameters (each
        with its own modifiers) are cheaper apart than stacked."""
        return min(self.max_parameters, 2 * largest_member + 16)


class _Group:
    """A stackable group being filled: its members and what its union holds so far."""

    def __init__(self, element: ElementLayout, index: int) -> None:
        self.key = element.stack_key
        self.signature: dict[str, tuple] = {}
        self.members: list[int] = []
        self.sizes: dict[str, int] = {}
        self.samples: set[int] = set()
        self.histosys: set[str] = set()
        self.largest = 0  # the most parameters of a member
        self.add(element, index)

    def add(self, element: ElementLayout, index: int) -> None:
        self.signature.update({p.name: _signature(p) for p in element.parameters})
        self.members.append(index)
        self.sizes.update({p.name: p.n_parameters for p in element.parameters})
        self.largest = max(self.largest, element.n_pars)
        self.samples.update(map(id, element.samples))
        self.histosys.update(_histosys_names(element))

    def takes(self, element: ElementLayout) -> bool:
        """Stackable with the group: equal structure key, no parameter of another size or
        constraint."""
        return element.stack_key == self.key and all(
            self.signature.get(p.name, sig) == sig
            for p, sig in ((p, _signature(p)) for p in element.parameters)
        )

    def fits(self, element: ElementLayout, budget: StackBudget) -> bool:
        """The union with ``element`` within ``budget``."""
        sizes = {**self.sizes, **{p.name: p.n_parameters for p in element.parameters}}
        if sum(sizes.values()) > budget.parameters_for(max(self.largest, element.n_pars)):
            return False
        histosys = len(self.histosys | set(_histosys_names(element)))
        samples = len(self.samples | set(map(id, element.samples)))
        need = 8 * _n_basis(element) * histosys * element.n_main * samples
        return need <= budget.max_variant_bytes


def partition(
    elements: Sequence[ElementLayout], budget: StackBudget | None = None
) -> list[list[int]]:
    """Indices of ``elements`` grouped into stackable sets, in order of first appearance.

    Elements with different channels, bins, POI or interpolation codes, or whose common
    parameters differ in size or constraint, land in different groups; with a ``budget``,
    so does an element that would grow a group's union past it (an element alone always
    makes a group: admission judges it alone).
    """
    groups: list[_Group] = []
    for index, element in enumerate(elements):
        for group in groups:
            if group.takes(element) and (budget is None or group.fits(element, budget)):
                group.add(element, index)
                break
        else:
            groups.append(_Group(element, index))
    return [group.members for group in groups]


def _histosys_names(element: ElementLayout) -> list[str]:
    """The names of an element's histosys parameters (scalar parameter sets)."""
    starts = offsets({p.name: p.n_parameters for p in element.parameters})
    name_at = {start: name for name, start in starts.items()}
    return [name_at[i] for i in element.histosys_params]


def split_reason(first: ElementLayout, other: ElementLayout) -> str:
    """Why ``other`` does not stack with ``first`` (for messages and ``meta``)."""
    if first.channels != other.channels:
        return f"channels and bins differ: {first.channels} vs {other.channels}"
    if first.poi_name != other.poi_name:
        return f"POI differs: {first.poi_name!r} vs {other.poi_name!r}"
    codes = (first.histosys_code, first.normsys_code)
    if codes != (other.histosys_code, other.normsys_code):
        return f"interpolation codes differ: {codes} vs {(other.histosys_code, other.normsys_code)}"
    known = {p.name: p for p in first.parameters}
    for parset in other.parameters:
        mine = known.get(parset.name)
        if mine is not None and _signature(mine) != _signature(parset):
            return f"parameter {parset.name!r} differs: {mine} vs {parset}"
    return "stackable"


def _signature(parset: ParameterSet) -> tuple:
    return (parset.n_parameters, parset.is_scalar, parset.constraint)


class StackLayout:
    """The union layout of stackable elements (see the module docstring)."""

    def __init__(self, elements: Sequence[ElementLayout]) -> None:
        if not elements:
            raise ValueError("a model needs at least one element")
        self.elements = list(elements)
        first = self.elements[0]
        for element in self.elements[1:]:
            reason = split_reason(first, element)
            if reason != "stackable":
                raise IncompatibleModelsError(
                    f"elements {first.name!r} and {element.name!r} cannot be stacked: {reason}"
                )
        self.n_elements = len(self.elements)
        self.n_main = first.n_main
        self._union_parameters()
        self._union_aux()
        self._variants()

    # ------------------------------------------------------------------------ parameters
    def _union_parameters(self) -> None:
        sets: dict[str, ParameterSet] = {}
        for element in self.elements:
            for parset in element.parameters:
                sets.setdefault(parset.name, parset)
        self.parameters = list(sets.values())
        starts = offsets({p.name: p.n_parameters for p in self.parameters})
        self.n_pars = sum(p.n_parameters for p in self.parameters)
        self.par_names = [label for p in self.parameters for label in p.labels()]
        self.poi_name = self.elements[0].poi_name
        self.poi_index = None if self.poi_name is None else starts[self.poi_name]
        # per element: the stack's column of each of its own parameters (pyhf's order)
        self.columns = [
            np.concatenate(
                [np.arange(starts[p.name], starts[p.name] + p.n_parameters) for p in e.parameters]
            ).astype(np.int64)
            for e in self.elements
        ]
        present = np.zeros((self.n_elements, self.n_pars), dtype=bool)
        init = np.zeros((self.n_elements, self.n_pars))
        bounds = np.zeros((self.n_elements, self.n_pars, 2))
        fixed = np.ones((self.n_elements, self.n_pars), dtype=bool)
        for e, (element, columns) in enumerate(zip(self.elements, self.columns, strict=True)):
            present[e, columns] = True
            init[e, columns] = element.init
            bounds[e, columns] = element.bounds
            fixed[e, columns] = element.fixed
        # absent parameters: held at the start value of an element that has them
        owner = present.argmax(axis=0)
        absent = ~present
        init[absent] = init[owner, np.arange(self.n_pars)][np.nonzero(absent)[1]]
        bounds[absent] = bounds[owner, np.arange(self.n_pars)][np.nonzero(absent)[1]]
        self.init, self.bounds, self.fixed = init, bounds, fixed
        histosys: dict[int, None] = {}
        for element, columns in zip(self.elements, self.columns, strict=True):
            histosys.update(dict.fromkeys(columns[element.histosys_params].tolist()))
        self.histosys_params = np.asarray(list(histosys), dtype=np.int64)
        self.kinked_params = self._kinked_params()

    def _kinked_params(self) -> np.ndarray:
        """Columns of the parameters whose interpolation code has a kink at 0 (sorted)."""
        first, kinked = self.elements[0], set()
        for element, columns in zip(self.elements, self.columns, strict=True):
            if first.histosys_code in KINKED_CODES:
                kinked.update(columns[element.histosys_params].tolist())
            if first.normsys_code in KINKED_CODES:
                kinked.update(columns[element.normsys_params].tolist())
        return np.asarray(sorted(kinked), dtype=np.int64)

    # ------------------------------------------------------------------------ constraints
    def _union_aux(self) -> None:
        slot_of: dict[int, int] = {}
        poisson: list[bool] = []
        self.aux_slots = []  # per element: the stack's slot of each of its auxiliary data
        for element, columns in zip(self.elements, self.columns, strict=True):
            slots = []
            for column, is_poisson in zip(
                columns[element.aux_param].tolist(), element.aux_is_poisson.tolist(), strict=True
            ):
                if column not in slot_of:
                    slot_of[column] = len(poisson)
                    poisson.append(is_poisson)
                slots.append(slot_of[column])
            self.aux_slots.append(np.asarray(slots, dtype=np.int64))
        self.aux_param = np.asarray(list(slot_of), dtype=np.int64)
        self.aux_is_poisson = np.asarray(poisson, dtype=bool)
        n_aux = len(poisson)
        self.n_aux = n_aux
        self.aux_sigma = np.ones((self.n_elements, n_aux))
        self.aux_scale = np.ones((self.n_elements, n_aux))
        self.aux_present = np.zeros((self.n_elements, n_aux), dtype=bool)
        # absent slots observe their parameter's start value: a zero pull, a harmless datum
        aux_observed = self.init[:, self.aux_param].copy()
        for e, (element, own) in enumerate(zip(self.elements, self.aux_slots, strict=True)):
            self.aux_sigma[e, own] = element.aux_sigma
            self.aux_scale[e, own] = element.aux_scale
            self.aux_present[e, own] = True
            aux_observed[e, own] = element.observed[self.n_main :]
        main_observed = np.stack([e.observed[: self.n_main] for e in self.elements])
        self.observed = np.concatenate([main_observed, aux_observed], axis=1)

    # ------------------------------------------------------------------------ variants
    def _variants(self) -> None:
        variant_of: dict[bytes, int] = {}
        variants: list[dict[str, np.ndarray]] = []
        members: list[list[int]] = []
        # a sample object the translator shares between elements (a background sample in one
        # numbering) is remapped and fingerprinted once per stack numbering of its element
        known: dict[tuple[int, tuple[bytes, ...]], int] = {}
        for element, remap in self._remappers():
            used = []
            for sample in element.samples:
                key = (id(sample), remap.numbering)
                if key not in known:
                    remapped = remap(sample)
                    fingerprint = _fingerprint(remapped)
                    if fingerprint not in variant_of:
                        variant_of[fingerprint] = len(variants)
                        variants.append(remapped)
                    known[key] = variant_of[fingerprint]
                used.append(known[key])
            members.append(used)
        self.n_variants = len(variants)
        self.symmetric_params = self._symmetric_params(variants, members)
        self.poi_gated = self._poi_gated(variants, members)
        everywhere = set.intersection(*(set(m) for m in members))
        common = [u for u in range(len(variants)) if u in everywhere]
        common_index = {u: i for i, u in enumerate(common)}
        self.membership = np.zeros((self.n_elements, len(common)))
        own: list[list[int]] = []
        for e, used in enumerate(members):
            own.append([u for u in used if u not in common_index])
            for u in used:
                if u in common_index:
                    self.membership[e, common_index[u]] += 1.0
        self.n_common = len(common)
        self.n_slots = max((len(o) for o in own), default=0)
        # [E, S]: each element's samples on the variant axis (common variants, then the
        # element's own slots in sample order; past its last sample, the padding position)
        self.sample_variant = np.full(
            (self.n_elements, max(map(len, members), default=0)),
            self.n_common + self.n_slots,
            dtype=np.int64,
        )
        for e, (used, own_variants) in enumerate(zip(members, own, strict=True)):
            slots = iter(range(self.n_common, self.n_common + len(own_variants)))
            for s, u in enumerate(used):
                self.sample_variant[e, s] = common_index[u] if u in common_index else next(slots)
        self.common = self._block([[variants[u] for u in common]])
        self.own = self._block([[variants[u] for u in o] for o in own], self.n_slots)

    def _poi_gated(self, variants: list[dict[str, np.ndarray]], members: list[list[int]]) -> bool:
        """Whether some element has a free parameter without a constraint term (a normfactor
        or shapefactor) that scales only rates the POI scales too (a second signal
        normfactor). At POI = 0 the likelihood is flat along it, so a fit started at POI = 0
        with it where the data pull the POI down stays there, although a larger value of it
        would let the POI rise to a lower minimum."""
        poi = self.poi_index
        if poi is None:
            return False
        # per variant (shared by elements), over the stack's columns and the padding column:
        # the multipliers of its bins that the POI scales too, and of those it does not
        with_poi = np.zeros((len(variants), self.n_pars + 1), dtype=bool)
        without_poi = np.zeros_like(with_poi)
        for u, variant in enumerate(variants):
            multipliers = variant["multipliers"]  # [depth, N] columns, padded
            scaled = (multipliers == poi).any(0)
            with_poi[u, multipliers[:, scaled]] = True
            without_poi[u, multipliers[:, ~scaled]] = True
        free = np.zeros((self.n_elements, self.n_pars + 1), dtype=bool)
        free[:, : self.n_pars] = ~self.fixed
        free[:, self.aux_param] = free[:, poi] = False
        return any(
            (with_poi[used].any(0) & ~without_poi[used].any(0) & free[e]).any()
            for e, used in enumerate(members)
        )

    def _symmetric_params(
        self, variants: list[dict[str, np.ndarray]], members: list[list[int]]
    ) -> np.ndarray:
        """``[E, P]`` bool: per element, the parameters that shift some of its rates, each
        shift even about ``alpha = 0`` (histosys and normsys with ``hi == lo``, smooth codes).
        Their likelihood is stationary at 0 whatever the data: a saddle where it curves down,
        which a fit started there never leaves (the fitter starts off it)."""
        first, n_variants = self.elements[0], len(variants)
        # per variant, over the stack's columns (and the multipliers' padding column)
        shifting = np.zeros((n_variants, self.n_pars + 1), dtype=bool)
        sloped = np.zeros_like(shifting)
        for u, variant in enumerate(variants if len(self.histosys_params) else ()):
            histosys = variant["histosys"]  # [K, J, N]
            shifting[u, self.histosys_params] = histosys.any(axis=(0, 2))
            slopes = histosys_slopes_at_nominal(first.histosys_code, histosys)
            sloped[u, self.histosys_params] = slopes.any(axis=1)
        entries: tuple[np.ndarray, ...] = (
            np.repeat(np.arange(n_variants), [len(v["normsys_param"]) for v in variants]),
        )
        if len(entries[0]):
            entries += (np.concatenate([v["normsys_param"] for v in variants]),)
            log_hi, log_lo = np.concatenate(
                [v["normsys_coefficients"][:2] for v in variants], axis=1
            )
            np.logical_or.at(shifting, entries, (log_hi != 0) | (log_lo != 0))
            np.logical_or.at(sloped, entries, log_hi != log_lo)
        # per element, over its variants (boolean reductions: a float product would wake
        # numpy's BLAS threads, which then spin on the cores the engine call is about to use)
        per_element = [shifting[used].any(0) & ~sloped[used].any(0) for used in members]
        symmetric = np.stack(per_element)[:, : self.n_pars]
        symmetric[:, self.kinked_params] = False  # kinked: started on both sides of the kink
        return symmetric

    def _remappers(self) -> Iterator[tuple[ElementLayout, _Remapper]]:
        """Per element, what puts its samples in the stack's numbering (:meth:`_remap`)."""
        position = np.full(self.n_pars + 1, -1, dtype=np.int64)  # column -> histosys slot
        position[self.histosys_params] = np.arange(len(self.histosys_params))
        for element, columns in zip(self.elements, self.columns, strict=True):
            histosys_slots = position[columns[element.histosys_params]]
            normsys_columns = columns[np.asarray(element.normsys_params, dtype=np.int64)]
            numbering = tuple(a.tobytes() for a in (columns, histosys_slots, normsys_columns))
            yield element, _Remapper(self, columns, histosys_slots, normsys_columns, numbering)

    def _remap(
        self,
        sample: SampleLayout,
        columns: np.ndarray,
        histosys_slots: np.ndarray,
        normsys_columns: np.ndarray,
    ) -> dict[str, np.ndarray]:
        """One sample in the stack's numbering: histosys over the stack's histosys
        parameters, parameter indices as stack columns, multipliers padded to a matrix.
        ``columns``: the element's parameters' stack columns; ``histosys_slots`` and
        ``normsys_columns``: where its histosys and normsys parameters go in the stack."""
        n_basis = sample.histosys.shape[0]
        histosys = np.zeros((n_basis, len(self.histosys_params), self.n_main))
        if sample.histosys.shape[1]:
            histosys[:, histosys_slots] = sample.histosys
        depth = max((len(m) for m in sample.multipliers), default=0)
        multipliers = np.full((depth, self.n_main), self.n_pars, dtype=np.int64)
        for b, indices in enumerate(sample.multipliers):
            multipliers[: len(indices), b] = columns[indices] if indices else []
        return {
            "nominal": sample.nominal,
            "histosys": histosys,
            "normsys_param": normsys_columns[sample.normsys_param]
            if len(sample.normsys_param)
            else np.zeros(0, dtype=np.int64),
            "normsys_bin": sample.normsys_bin,
            "normsys_coefficients": sample.normsys_coefficients,
            "multipliers": multipliers,
        }

    def _block(
        self, groups: list[list[dict[str, np.ndarray]]], slots: int | None = None
    ) -> VariantBlock:
        """Variants in ``len(groups)`` rows of ``slots`` slots each (empty slots: zero rates)."""
        n_main, rows = self.n_main, len(groups)
        slots = max((len(g) for g in groups), default=0) if slots is None else slots
        n_basis = _n_basis(self.elements[0])
        # the histosys parameters that shift some variant of the block (others cost nothing)
        shifting = np.zeros(len(self.histosys_params), dtype=bool)
        for v in (v for g in groups for v in g):
            shifting |= np.any(v["histosys"] != 0, axis=(0, 2))
        n_hist = int(shifting.sum())
        width = max((sum(len(v["normsys_param"]) for v in g) for g in groups), default=0)
        depth = max((v["multipliers"].shape[0] for g in groups for v in g), default=0)
        nominal = np.zeros((rows, slots * n_main))
        histosys = np.zeros((rows, n_basis * n_hist, slots * n_main))
        normsys_param = np.zeros((rows, width), dtype=np.int64)
        normsys_column = np.zeros((rows, width), dtype=np.int64)
        normsys_coefficients = np.zeros((8, rows, width))
        multipliers = np.full((rows, depth, slots * n_main), self.n_pars, dtype=np.int64)
        for r, group in enumerate(groups):
            t = 0
            for s, v in enumerate(group):
                cols = slice(s * n_main, (s + 1) * n_main)
                nominal[r, cols] = v["nominal"]
                histosys[r, :, cols] = v["histosys"][:, shifting].reshape(-1, n_main)
                count = len(v["normsys_param"])
                normsys_param[r, t : t + count] = v["normsys_param"]
                normsys_column[r, t : t + count] = s * n_main + v["normsys_bin"]
                normsys_coefficients[:, r, t : t + count] = v["normsys_coefficients"]
                t += count
                multipliers[r, : v["multipliers"].shape[0], cols] = v["multipliers"]
        return VariantBlock(
            nominal,
            self.histosys_params[shifting],
            histosys,
            normsys_param,
            normsys_column,
            normsys_coefficients,
            multipliers,
        )

    @property
    def structure_key(self) -> str:
        """Equal for stacks whose tensors have equal shapes and meaning (compile caches)."""
        key = [
            self.elements[0].stack_key,
            self.par_names,
            self.n_aux,
            self.n_common,
            self.n_slots,
            list(self.common.multiplier_params.shape),
            list(self.own.multiplier_params.shape[1:]),
        ]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()


@dataclass(frozen=True)
class _Remapper:
    """One element's samples into the stack's numbering (:meth:`StackLayout._remap`);
    ``numbering`` is equal for elements whose samples it maps alike."""

    stack: StackLayout
    columns: np.ndarray
    histosys_slots: np.ndarray
    normsys_columns: np.ndarray
    numbering: tuple[bytes, ...]

    def __call__(self, sample: SampleLayout) -> dict[str, np.ndarray]:
        return self.stack._remap(sample, self.columns, self.histosys_slots, self.normsys_columns)


def _n_basis(element: ElementLayout) -> int:
    return element.samples[0].histosys.shape[0] if element.samples else 0


def _fingerprint(variant: dict[str, np.ndarray]) -> bytes:
    """Bytes that are equal exactly when two remapped samples compute the same rates."""
    digest = hashlib.sha256()
    for name in sorted(variant):
        array = np.ascontiguousarray(variant[name])
        digest.update(name.encode())
        digest.update(str(array.shape).encode())
        digest.update(array.tobytes())
    return digest.digest()
