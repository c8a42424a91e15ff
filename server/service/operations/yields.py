"""``POST /yields``: pre- and post-fit yields per channel, sample and bin with their
uncertainties, and the data (cabinetry's ``model_utils.prediction`` and ``yield_stdev``)."""

from __future__ import annotations

from pyhf_gpu_server import inference
from pyhf_gpu_server.engine import HistFactoryModel
from pyhf_gpu_server.inference.yields import YieldSet, YieldsResults

from ..schemas import ChannelYields, SampleYields, YieldsAnswer, YieldsOptions, YieldsResult
from .base import EngineRows, Operation, RowResult, RowStatus, uncertainty_flags


class Yields(Operation[YieldsOptions]):
    """One row per element: its fit, then every parameter variation's yields in one batch."""

    name = "yields"
    summary = "Pre- and post-fit yields per channel, sample and bin, with uncertainties"
    options_model = YieldsOptions
    result_model = YieldsResult

    def row_cost(self, options: YieldsOptions) -> float:
        return 4.0  # the fit from two starts, its Hessian, the variations

    def run(
        self, model: HistFactoryModel, rows: EngineRows, options: YieldsOptions
    ) -> list[RowResult]:
        result = inference.yields(model, element=rows.element, options=rows.fit)
        statuses = RowStatus.of(result, len(rows))
        out = []
        for i, status in enumerate(statuses):
            uncertainty = result.fit.uncertainty[i].tolist()
            flags = uncertainty_flags(
                [model.par_names[c] for c in rows.columns[i]],
                [uncertainty[c] for c in rows.columns[i]],
            )
            answer = YieldsAnswer(
                prefit=channel_yields(result, result.prefit, i),
                postfit=channel_yields(result, result.postfit, i),
            )
            out.append(RowResult(answer, status, flags=flags))
        return out


def channel_yields(result: YieldsResults, part: YieldSet, i: int) -> dict[str, ChannelYields]:
    """Row ``i`` of ``part`` (pre- or post-fit) by channel: each sample's and the total's
    per-bin yields and uncertainties with their channel sums, and the data."""
    names = result.samples[int(result.element[i])]
    per_sample = [
        t[i].tolist() for t in (part.yields, part.stdev, part.channel_yields, part.channel_stdev)
    ]
    total = [
        t[i].tolist()
        for t in (part.total, part.total_stdev, part.channel_total, part.channel_total_stdev)
    ]
    data, channel_data = result.data[i].tolist(), result.channel_data[i].tolist()
    out, start = {}, 0
    for c, (channel, bins) in enumerate(result.channels):
        stop = start + bins

        def entry(values, stdevs, sums, sum_stdevs, start=start, stop=stop, c=c) -> SampleYields:
            return SampleYields(
                yields=values[start:stop],
                stdev=stdevs[start:stop],
                channel_yield=sums[c],
                channel_stdev=sum_stdevs[c],
            )

        out[channel] = ChannelYields(
            bins=bins,
            samples={name: entry(*(t[s] for t in per_sample)) for s, name in enumerate(names)},
            total=entry(*total),
            data=data[start:stop],
            channel_data=channel_data[c],
        )
        start = stop
    return out
