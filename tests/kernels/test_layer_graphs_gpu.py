"""Whole-layer CUDA graphs on the GPU: for every backend that says it can be captured and every
token bucket, the replay of a padded batch equals the uncaptured forward of the same rows
(router, routing, experts, shared expert), on awkward sizes: 1, one past each bucket, the
largest. Layers: demo-like (bf16, top-2), DeepSeek-like (fp8-block, sigmoid groups, correction
bias, shared expert), gpt-oss-like (swigluoai, biases: the oai-triton backends)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_serve.bench.random_layer import random_layer
from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.config import ActivationSpec, GroupScore, MoEConfig, RoutingConfig, Scoring
from moe_serve.kernels.layer import build_layer, expert_tokens
from moe_serve.kernels.layer_graphs import LayerGraphs, can_capture, token_buckets
from moe_serve.kernels.placement import Placement
from moe_serve.kernels.prepare_finalize.naive_ep import NaiveEP
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.registry import experts_backends
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.ep.group import leave
from tests.kernels.ranks import run_ranks

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
MAX_TOKENS = 96  # buckets 1, 2, 4, ..., 64, 96
SHARED = 128  # shared expert intermediate size

LAYERS = {
    "demo-like": MoEConfig(8, 256, 512, RoutingConfig(top_k=2)),
    "deepseek-like": MoEConfig(
        16,
        256,
        256,
        RoutingConfig(
            top_k=4,
            scoring=Scoring.SIGMOID,
            num_groups=4,
            topk_groups=2,
            group_score=GroupScore.TOP2_SUM,
            routed_scaling_factor=2.5,
        ),
        quant=QuantConfig(QuantScheme.FP8_BLOCK),
    ),
    "gpt-oss-like": MoEConfig(
        8,
        256,
        256,
        RoutingConfig(top_k=4, softmax_after_topk=True),
        activation=ActivationSpec(kind="swigluoai", gate_up="interleaved"),
        has_bias=True,
    ),
}
TOLERANCE = {"demo-like": 1e-2, "deepseek-like": 3e-2, "gpt-oss-like": 1e-2}


def _sizes() -> list[int]:
    """1, one past every bucket below the largest, and the largest."""
    buckets = token_buckets(MAX_TOKENS)
    return sorted({1, MAX_TOKENS} | {b + 1 for b in buckets if b + 1 <= MAX_TOKENS})


CAPTURABLE = sorted(name for name, cls in experts_backends().items() if cls.graph_capturable)


@pytest.mark.parametrize("backend", CAPTURABLE)
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_graph_replay_equals_the_uncaptured_forward_at_every_bucket(
    layer_name: str, backend: str
) -> None:
    cfg = LAYERS[layer_name]
    support = experts_backends()[backend].supports(cfg, CUDA)
    if not support:
        pytest.skip(f"{backend} does not run {layer_name}: {support.reason}")
    shared = SHARED if layer_name == "deepseek-like" else None
    weights = random_layer(cfg, CUDA, seed=3, router=True, shared_intermediate=shared)
    layer, _ = build_layer(cfg, weights, CUDA, backend)
    assert can_capture(layer, CUDA, MAX_TOKENS)
    graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=False)
    with torch.inference_mode():
        graphs.capture()
        assert graphs.captured_buckets() == list(token_buckets(MAX_TOKENS))
        generator = torch.Generator(CUDA).manual_seed(0)
        for m in _sizes():
            x = torch.randn(m, cfg.hidden_size, generator=generator, device=CUDA).to(cfg.dtype)
            eager = layer.forward(ForwardInputs(x))
            replay = graphs.forward(ForwardInputs(x))
            where = f"{backend} {layer_name} m={m} (bucket {graphs.bucket(m)})"
            assert replay.output.output.shape == (m, cfg.hidden_size), where
            assert torch.equal(replay.output.routing.topk_ids, eager.routing.topk_ids), where
            torch.testing.assert_close(
                replay.output.routing.topk_weights, eager.routing.topk_weights, msg=where
            )
            error = relative_error(replay.output.output, eager.output)
            assert error < TOLERANCE[layer_name], f"{where}: {error:.2e}"
            expected = expert_tokens(eager.routing.topk_ids, cfg.num_experts)
            assert torch.equal(replay.expert_tokens, expected), where


def test_a_graph_replay_after_a_larger_one_leaves_no_trace_of_it() -> None:
    """Padded rows are zeroed: a small batch after a large one answers as it would alone."""
    cfg = LAYERS["demo-like"]
    weights = random_layer(cfg, CUDA, seed=4, router=True)
    layer, _ = build_layer(cfg, weights, CUDA, "triton")
    graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=False)
    with torch.inference_mode():
        graphs.capture()
        big = torch.randn(MAX_TOKENS, cfg.hidden_size, device=CUDA).to(cfg.dtype) * 100
        small = torch.randn(3, cfg.hidden_size, device=CUDA).to(cfg.dtype)
        alone = graphs.forward(ForwardInputs(small)).output.output.clone()
        graphs.forward(ForwardInputs(big))
        again = graphs.forward(ForwardInputs(small)).output.output
        assert torch.equal(alone, again)


def test_graphs_with_client_logits_route_by_them() -> None:
    cfg = LAYERS["demo-like"]
    weights = random_layer(cfg, CUDA, seed=5)  # no stored router
    layer, _ = build_layer(cfg, weights, CUDA, "triton")
    graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=True)
    with torch.inference_mode():
        graphs.capture()
        x = torch.randn(5, cfg.hidden_size, device=CUDA).to(cfg.dtype)
        logits = torch.randn(5, cfg.num_experts, device=CUDA)
        eager = layer.forward(ForwardInputs(x, logits))
        replay = graphs.forward(ForwardInputs(x, logits)).output
        assert torch.equal(replay.routing.topk_ids, eager.routing.topk_ids)
        assert relative_error(replay.output, eager.output) < TOLERANCE["demo-like"]


def test_each_copy_replays_its_own_inputs_and_checks_its_valid_rows_finite() -> None:
    """Two copies staged before either replays (as the service's two slots are) answer as their
    own batches alone; a NaN in a valid row clears `finite` and `inputs_finite`, one in a padded
    row does not (the graph zeroes padding)."""
    cfg = LAYERS["demo-like"]
    weights = random_layer(cfg, CUDA, seed=6, router=True)
    layer, _ = build_layer(cfg, weights, CUDA, "triton")
    graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=False, copies=2)
    with torch.inference_mode():
        graphs.capture()
        assert graphs.captured_buckets() == list(token_buckets(MAX_TOKENS))
        batches = [torch.randn(m, cfg.hidden_size, device=CUDA).to(cfg.dtype) for m in (5, 3)]
        for copy, x in enumerate(batches):
            graphs.inputs[copy].hidden[: len(x)].copy_(x)
            graphs.inputs[copy].hidden[len(x) :].fill_(float("nan"))  # stale padding
            graphs.inputs[copy].valid_rows.fill_(len(x))
        for copy, x in enumerate(batches):
            replay = graphs.replay(len(x), copy)
            eager = layer.forward(ForwardInputs(x))
            assert torch.equal(replay.output.routing.topk_ids, eager.routing.topk_ids)
            assert relative_error(replay.output.output, eager.output) < TOLERANCE["demo-like"]
            assert (int(replay.finite), int(replay.inputs_finite)) == (1, 1)
            expected = expert_tokens(eager.routing.topk_ids, cfg.num_experts)
            assert torch.equal(replay.expert_tokens, expected)
        poisoned = batches[0].clone()
        poisoned[2, 7] = float("nan")
        flagged = graphs.forward(ForwardInputs(poisoned), copy=1)
        assert (int(flagged.finite), int(flagged.inputs_finite)) == (0, 0)
        clean = graphs.forward(ForwardInputs(batches[0]), copy=1)
        assert (int(clean.finite), int(clean.inputs_finite)) == (1, 1)


@pytest.mark.parametrize("backend", CAPTURABLE)
def test_a_copys_outputs_survive_the_other_copies_replays(backend: str) -> None:
    """As the service's pipeline runs them: each copy replays while the previous copies'
    outputs wait to be copied out. The last copy captured is replayed first and read last, at
    the largest bucket and one past a smaller one (in a pool shared by every copy its outputs
    could lie where the other copies keep temporaries)."""
    cfg = LAYERS["deepseek-like"]
    support = experts_backends()[backend].supports(cfg, CUDA)
    if not support:
        pytest.skip(f"{backend} does not run deepseek-like: {support.reason}")
    weights = random_layer(cfg, CUDA, seed=7, router=True, shared_intermediate=SHARED)
    layer, _ = build_layer(cfg, weights, CUDA, backend)
    graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=False, copies=3)
    with torch.inference_mode():
        graphs.capture()
        for rows in (MAX_TOKENS, 33):
            batches = [
                torch.randn(rows, cfg.hidden_size, device=CUDA).to(cfg.dtype) for _ in range(3)
            ]
            for copy, x in enumerate(batches):
                graphs.inputs[copy].hidden[:rows].copy_(x)
                graphs.inputs[copy].valid_rows.fill_(rows)
            replays = {copy: graphs.replay(rows, copy) for copy in (2, 0, 1)}
            for copy, x in enumerate(batches):
                eager = layer.forward(ForwardInputs(x))
                got = replays[copy].output
                where = f"{backend} copy {copy} rows {rows}"
                assert torch.equal(got.routing.topk_ids, eager.routing.topk_ids), where
                error = relative_error(got.output, eager.output)
                assert error < TOLERANCE["deepseek-like"], f"{where}: {error:.2e}"


@pytest.mark.parametrize("backend", CAPTURABLE)
def test_shared_experts_on_the_side_stream_answer_as_in_line(backend: str) -> None:
    """The shared experts run on a side stream, joined only by the pass that adds their
    output: eager and captured, the layer's output is bit-identical to the forward that runs
    them in line, at one token and past the largest bucket's half. A shared expert wider than
    the routed ones, so that a missing wait would read its output unwritten."""
    cfg = LAYERS["deepseek-like"]
    support = experts_backends()[backend].supports(cfg, CUDA)
    if not support:
        pytest.skip(f"{backend} does not run deepseek-like: {support.reason}")
    weights = random_layer(cfg, CUDA, seed=8, router=True, shared_intermediate=16 * SHARED)
    layer, _ = build_layer(cfg, weights, CUDA, backend)
    assert layer.side_stream is not None
    with torch.inference_mode():
        side = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=False)
        side.capture()
        batches = [torch.randn(m, cfg.hidden_size, device=CUDA).to(cfg.dtype) for m in (1, 49)]
        eager_side = [layer.forward(ForwardInputs(x)).output for x in batches]
        replay_side = [side.forward(ForwardInputs(x)).output.output.clone() for x in batches]
        layer.side_stream = None
        in_line = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=False)
        in_line.capture()
        for i, x in enumerate(batches):
            where = f"{backend} m={len(x)}"
            assert torch.equal(eager_side[i], layer.forward(ForwardInputs(x)).output), where
            replay = in_line.forward(ForwardInputs(x)).output.output
            assert torch.equal(replay_side[i], replay), where


def _sender_layer_graphs(rank: int, port: int) -> None:
    """One NCCL rank that is expert parallelism's sender over all the experts: its graphs end
    a prologue where the broadcast begins and begin an epilogue where the reduce ends, which
    may run beside other batches' forwards (service/engine/pipeline.py) and still answer bit for bit
    as the graphs replayed one after the other."""
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    cfg = LAYERS["deepseek-like"]
    weights = random_layer(cfg, CUDA, seed=9, router=True, shared_intermediate=SHARED)
    expert_map = Placement.contiguous(cfg.num_experts, 1).expert_map(0).to(CUDA)
    layer, _ = build_layer(
        cfg, weights, CUDA, "triton", expert_map=expert_map, prepare_finalize=NaiveEP(sender=0)
    )
    graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=False, copies=2)
    with torch.inference_mode():
        graphs.capture()
        phases = {len(captured.graphs) for copy in graphs._graphs for captured in copy.values()}
        assert phases == {3}, phases  # prologue, collectives, epilogue: every bucket and copy
        for m in (1, 33, MAX_TOKENS):
            batches = [torch.randn(m, cfg.hidden_size, device=CUDA).to(cfg.dtype) for _ in "ab"]
            alone = []
            for copy, x in enumerate(batches):
                graphs.inputs[copy].hidden[:m].copy_(x)
                graphs.inputs[copy].valid_rows.fill_(m)
                alone.append(graphs.replay(m, copy).output.output.clone())
                eager = layer.forward(ForwardInputs(x)).output
                assert relative_error(alone[-1], eager) < TOLERANCE["deepseek-like"], m
            ahead, main, after = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
            for stream in (ahead, main, after):
                stream.wait_stream(torch.cuda.current_stream())
            outputs, done = [], [torch.cuda.Event() for _ in batches]
            for _ in range(3):  # a copy's ends queued beside the other copy's collectives
                for copy in range(2):
                    ahead.wait_event(done[copy])  # after this copy's last replay only
                    with torch.cuda.stream(ahead):
                        graphs.replay_prologue(m, copy)
                    main.wait_stream(ahead)
                    with torch.cuda.stream(main):
                        replay = graphs.replay(m, copy, ends=False)
                    after.wait_stream(main)
                    with torch.cuda.stream(after):
                        graphs.replay_epilogue(m, copy)
                        outputs.append((copy, replay.output.output.clone()))
                    done[copy].record(after)
            torch.cuda.synchronize()
            for copy, out in outputs:
                assert torch.equal(out, alone[copy]), f"m={m} copy {copy}"
    leave(0)  # no NCCL teardown of a communicator the graphs hold (service/ep/group.py)


def test_an_expert_parallel_senders_prologue_and_epilogue_run_beside_other_batches() -> None:
    run_ranks(_sender_layer_graphs, (), nprocs=1, timeout_s=300)
