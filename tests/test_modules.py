"""The Mamba layer: mamba_ssm's parameter names and initialization, fast path against the
separate conv + scan path, decoding against the full forward, and the layer compiled for
training, exported (save/load) and packaged with AOTInductor."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from model_helpers import compile_fullgraph, hermetic_compile, train

from selective_scan.modules import Mamba

D_MODEL = 20  # d_inner = 2 * 20 = 40, dt_rank = ceil(20 / 16) = 2; d_state 4, d_conv 4
D_STATE = 4


def mamba_ssm_state(bias: bool, conv_bias: bool) -> dict:
    """The state_dict of mamba_ssm.modules.mamba_simple.Mamba(d_model=20, d_state=4, bias=bias,
    conv_bias=conv_bias), written out by hand from its parameters: name -> shape, in order."""
    state = {"A_log": (40, 4), "D": (40,), "in_proj.weight": (80, 20)}
    if bias:
        state["in_proj.bias"] = (80,)
    state["conv1d.weight"] = (40, 1, 4)
    if conv_bias:
        state["conv1d.bias"] = (40,)
    state |= {
        "x_proj.weight": (2 + 2 * 4, 40),  # dt_rank + 2 * d_state rows
        "dt_proj.weight": (40, 2),
        "dt_proj.bias": (40,),
        "out_proj.weight": (20, 40),
    }
    if bias:
        state["out_proj.bias"] = (20,)
    return state


def make_layer(seed: int = 0, **options) -> Mamba:
    torch.manual_seed(seed)
    return Mamba(D_MODEL, **{"d_state": D_STATE} | options)


def hidden(batch: int = 2, seqlen: int = 13, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, D_MODEL, generator=gen)


BIASES = pytest.mark.parametrize(
    ("bias", "conv_bias"), [(False, True), (True, False)], ids=["default", "bias-no_conv_bias"]
)


@BIASES
def test_state_dict_has_mamba_ssm_names_and_shapes(bias, conv_bias):
    layer = make_layer(bias=bias, conv_bias=conv_bias)
    state = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert list(state.items()) == list(mamba_ssm_state(bias, conv_bias).items())


@BIASES
def test_mamba_ssm_state_dict_loads_strictly(bias, conv_bias):
    gen = torch.Generator().manual_seed(2)
    checkpoint = {
        k: torch.randn(shape, generator=gen)
        for k, shape in mamba_ssm_state(bias, conv_bias).items()
    }
    layer = make_layer(bias=bias, conv_bias=conv_bias)
    layer.load_state_dict(checkpoint, strict=True)
    for name, value in layer.state_dict().items():
        assert torch.equal(value, checkpoint[name]), name


def test_initialization_follows_mamba_ssm():
    dt_min, dt_max = 0.001, 0.1
    layer = make_layer(dt_min=dt_min, dt_max=dt_max)
    assert torch.equal(layer.A_log, torch.log(torch.arange(1.0, D_STATE + 1)).expand(40, -1))
    assert torch.equal(layer.D, torch.ones(40))
    assert layer.A_log._no_weight_decay and layer.D._no_weight_decay
    dt = F.softplus(layer.dt_proj.bias.double())
    assert dt.min() >= dt_min * (1 - 1e-5) and dt.max() <= dt_max * (1 + 1e-5)
    assert dt.max() / dt.min() > 10  # spread log-uniformly over the range, not constant
    std = layer.dt_rank**-0.5
    assert layer.dt_proj.weight.abs().max() <= std
    constant = make_layer(dt_init="constant", dt_scale=2.0).dt_proj.weight
    assert torch.equal(constant, torch.full_like(constant, 2.0 * std))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(dt_init="xavier"), "dt_init must be 'random' or 'constant'"),
        (dict(d_state=0), "d_state must be a positive integer, got 0"),
        (dict(dt_rank=0), "dt_rank must be a positive integer, got 0"),
        (dict(expand=0), r"d_inner = expand \* d_model must be a positive integer, got 0"),
    ],
)
def test_bad_constructor_arguments_are_rejected(options, match):
    with pytest.raises(ValueError, match=match):
        make_layer(**options)


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["fast", "slow"])
@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda h: h[0], ValueError, "hidden_states must have 3 dimensions"),
        (lambda h: h[..., :-1], ValueError, r"hidden_states must have shape \(batch, seqlen, d_m"),
        (lambda h: h.double(), TypeError, "hidden_states must have the layer's dtype"),
        (lambda h: h.to("meta"), ValueError, "hidden_states is on meta but the layer is on cpu"),
        (lambda h: h[:, :0], ValueError, r"hidden_states must be non-empty"),
    ],
)
def test_bad_hidden_states_are_named(use_fast_path, change, error, match):
    """Both paths check hidden_states before the projections, whose own errors name no
    argument (a wrong d_model: "mat1 and mat2 shapes cannot be multiplied")."""
    with pytest.raises(error, match=match):
        make_layer(use_fast_path=use_fast_path)(change(hidden()))


def test_step_checks_ssm_state():
    layer = make_layer()
    conv_state, ssm_state = layer.allocate_inference_cache(2, 2)
    with pytest.raises(ValueError, match=r"ssm_state must have shape \(batch, d_inner, d_state\)"):
        layer.step(hidden(seqlen=1), conv_state, ssm_state[..., :-1])


def outputs_and_grads(layer: Mamba, x: torch.Tensor):
    out = layer(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((out * w).sum(), [x, *layer.parameters()])
    return out, grads


@BIASES
def test_fast_path_matches_conv_and_scan_path(bias, conv_bias):
    fast = make_layer(bias=bias, conv_bias=conv_bias)
    slow = copy.deepcopy(fast)
    slow.use_fast_path = False
    x = hidden().requires_grad_(True)
    out, grads = outputs_and_grads(fast, x)
    expected, expected_grads = outputs_and_grads(slow, x)
    assert_close("out", out, expected, 1e-6)
    names = ["x", *(name for name, _ in fast.named_parameters())]
    for name, grad, exp in zip(names, grads, expected_grads, strict=True):
        assert_close(f"grad of {name}", grad, exp, 1e-6)


@torch.no_grad()
@pytest.mark.parametrize("prompt", [0, 2, 6], ids=lambda n: f"prompt={n}")
def test_prefill_then_steps_match_forward(prompt):
    """prompt=0 steps every token from allocate_inference_cache's zero states; 2 is shorter
    than the conv (the conv state is partly padding)."""
    layer = make_layer().eval()
    x = hidden(batch=3, seqlen=10)
    expected = layer(x)
    if prompt:
        out, conv_state, ssm_state = layer.prefill(x[:, :prompt])
        assert_close("prefill", out, expected[:, :prompt], 1e-6)
    else:
        conv_state, ssm_state = layer.allocate_inference_cache(3, max_seqlen=10)
    for t in range(prompt, 10):
        out, new_conv, new_ssm = layer.step(x[:, t : t + 1], conv_state, ssm_state)
        assert new_conv is conv_state and new_ssm is ssm_state  # updated in place
        assert_close(f"step {t}", out, expected[:, t : t + 1], 1e-5)


@torch.no_grad()
def test_inference_params_prefill_then_decode():
    """mamba_ssm's generation protocol: a cache dict keyed by layer_idx and seqlen_offset."""
    layer = make_layer(layer_idx=0).eval()
    x = hidden(batch=2, seqlen=9)
    expected = layer(x)
    params = SimpleNamespace(key_value_memory_dict={}, seqlen_offset=0)
    assert_close("prefill", layer(x[:, :5], inference_params=params), expected[:, :5], 1e-6)
    for t in range(5, 9):
        params.seqlen_offset = t
        out = layer(x[:, t : t + 1], inference_params=params)
        assert_close(f"step {t}", out, expected[:, t : t + 1], 1e-5)


def test_step_rejects_more_than_one_token():
    layer = make_layer()
    with pytest.raises(ValueError, match=r"hidden_states must have shape \(batch, 1, d_model\)"):
        layer.step(hidden(seqlen=2), *layer.allocate_inference_cache(2, 2))


@pytest.fixture(scope="module", autouse=True)
def no_compile_caches():
    """Module scope, so that the module-scoped export and package are made under it too."""
    with hermetic_compile():
        yield


def test_compiled_training_step_has_no_graph_break_and_matches_eager():
    eager = make_layer(seed=4)
    module = copy.deepcopy(eager)
    compiled, check_one_graph = compile_fullgraph(module)
    x, target = hidden(seed=5), hidden(seed=6)

    def loss_fn(out):
        return F.mse_loss(out, target)

    losses = train(compiled, loss_fn, x)
    check_one_graph()
    for step, (loss, expected) in enumerate(zip(losses, train(eager, loss_fn, x), strict=True)):
        assert_close(f"loss of step {step}", loss, expected, 1e-5)
    for (name, param), expected in zip(module.named_parameters(), eager.parameters(), strict=True):
        assert_close(f"{name} after training", param, expected, 1e-5)


@pytest.fixture(scope="module")
def layer():
    return make_layer(seed=7).eval()


@pytest.fixture(scope="module")
def exported(layer):
    # Sizes 0 and 1 would specialize: both dims are dynamic from 2 up.
    dims = {0: torch.export.Dim("batch", min=2), 1: torch.export.Dim("seqlen", min=2)}
    return torch.export.export(layer, (hidden(batch=3, seqlen=17),), dynamic_shapes=(dims,))


@pytest.fixture(scope="module")
def package(exported, tmp_path_factory):
    """AOTInductor compiles for tens of seconds on this 2-core machine: once per module."""
    path = tmp_path_factory.mktemp("aoti") / "mamba.pt2"
    return torch._inductor.aoti_compile_and_package(exported, package_path=str(path))


def assert_matches_eager(run, layer, batch: int, seqlen: int, tol: float = 1e-6) -> None:
    x = hidden(batch=batch, seqlen=seqlen, seed=batch * 1000 + seqlen)
    with torch.no_grad():
        assert_close("out", run(x), layer(x), tol)


SIZES = pytest.mark.parametrize(("batch", "seqlen"), [(2, 2), (5, 70)])


@SIZES
def test_exported_prefill_matches_eager(exported, layer, batch, seqlen):
    assert_matches_eager(exported.module(), layer, batch, seqlen)


def test_exported_save_load_round_trip(exported, layer, tmp_path):
    path = tmp_path / "mamba.pt2"
    torch.export.save(exported, path)
    assert_matches_eager(torch.export.load(path).module(), layer, batch=4, seqlen=33)


@SIZES
def test_aoti_package_matches_eager(package, layer, batch, seqlen):
    # Inductor computes -exp(A_log), softplus and the linears itself: last-bit differences.
    assert_matches_eager(torch._inductor.aoti_load_package(package), layer, batch, seqlen, 1e-5)


def test_dt_rank_auto_is_ceil_d_model_over_16():
    assert make_layer().dt_rank == math.ceil(D_MODEL / 16) == 2
