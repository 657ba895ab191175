"""LoRA adapters on the embedded engine, over real sockets: several adapters on one base, each
request through the one it names (SGLang's `lora_path`), per-adapter updates and weight versions.

One engine process per module, serving the session's tiny model with two adapters whose weights
are drawn at random (an adapter fresh from `ensure_adapter` equals the base, which would hide a
request routed to the wrong one).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_local_engine import call, generate, out_ids, out_logprobs, wait_running

from mrlx_plugin.local.model import ensure_model
from mrlx_plugin.local.services import ProcessStartError, router_available, start_engine, start_router

PROMPT = [1, 74, 75, 20, 21, 9]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def random_adapter(base_dir: Path, out: Path, seed: int, **settings) -> Path:
    """A peft LoRA adapter on `base_dir` whose B matrices are random, so it changes the outputs;
    `settings` go to its LoraConfig."""
    import torch
    from peft import LoraConfig, get_peft_model

    from mrlx_plugin.local.model import load_model

    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, **settings)
    model = get_peft_model(load_model(base_dir), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "alpha": random_adapter(tiny_model_dir, root / "alpha", 1),
        "beta": random_adapter(tiny_model_dir, root / "beta", 2),
        "alpha-next": random_adapter(tiny_model_dir, root / "alpha-next", 3),
    }


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, adapters, logs_dir):
    proc = start_engine(
        tiny_model_dir,
        log_dir=logs_dir,
        name="engine-lora",
        threads=1,
        extra=["--lora-paths", f"alpha={adapters['alpha']}", f"beta={adapters['beta']}"],
    )
    yield proc.url
    proc.stop()


def through(url: str, adapter: str | None, **params) -> dict:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {**GREEDY, **params},
        "return_logprob": True,
        "lora_path": adapter,
    }
    status, out = call(url + "/generate", body)
    assert status == 200, out
    return out


def test_each_request_goes_through_the_adapter_it_names(lora_engine):
    base = out_logprobs(generate(lora_engine, PROMPT, **GREEDY))
    alpha = out_logprobs(through(lora_engine, "alpha"))
    beta = out_logprobs(through(lora_engine, "beta"))
    assert alpha != base and beta != base and alpha != beta
    assert out_logprobs(through(lora_engine, None)) == base  # no lora_path: the base model
    # A batched body mixes adapters row by row, each row as it is alone.
    status, rows = call(
        lora_engine + "/generate",
        {
            "input_ids": [PROMPT, PROMPT, PROMPT],
            "sampling_params": GREEDY,
            "return_logprob": True,
            "lora_path": ["beta", None, "alpha"],
        },
    )
    assert status == 200, rows
    got = [out_logprobs(r) for r in rows]
    assert got[0] == pytest.approx(beta, abs=1e-5)
    assert got[1] == pytest.approx(base, abs=1e-5)
    assert got[2] == pytest.approx(alpha, abs=1e-5)


def test_an_unknown_adapter_is_a_clear_400(lora_engine):
    status, out = call(
        lora_engine + "/generate",
        {"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "gamma"},
    )
    assert status == 400
    assert "'gamma'" in out["error"]["message"] and "alpha, beta" in out["error"]["message"]
    status, out = call(
        lora_engine + "/generate",
        {"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY, "lora_path": ["alpha", "gamma"]},
    )
    assert status == 400 and out["error"]["message"].startswith("lora_path[1]:")


def test_updating_one_adapter_leaves_the_other_and_the_base_unchanged(lora_engine, adapters):
    before = {name: out_logprobs(through(lora_engine, name)) for name in ("alpha", "beta", None)}
    status, out = call(
        lora_engine + "/load_lora_adapter",
        {"lora_name": "alpha", "lora_path": str(adapters["alpha-next"]), "upsert": True, "weight_version": 7},
    )
    assert status == 200 and out["success"], out
    assert out["weight_versions"] == {"alpha": "7", "beta": "0"}
    after = {name: through(lora_engine, name) for name in ("alpha", "beta", None)}
    assert out_logprobs(after["alpha"]) != before["alpha"]
    assert out_logprobs(after["beta"]) == before["beta"]
    assert out_logprobs(after[None]) == before[None]
    # Each answer reports the version of the weights that produced it.
    assert after["alpha"]["meta_info"]["weight_version"] == "7"
    assert after["beta"]["meta_info"]["weight_version"] == "0"
    info = call(lora_engine + "/server_info")[1]
    assert info["lora_adapters"]["alpha"] == {"lora_path": str(adapters["alpha-next"]), "weight_version": "7"}
    # Back to the first weights: the same outputs as before the update.
    status, out = call(
        lora_engine + "/load_lora_adapter",
        {"lora_name": "alpha", "lora_path": str(adapters["alpha"]), "upsert": True, "weight_version": 8},
    )
    assert status == 200, out
    assert out_logprobs(through(lora_engine, "alpha")) == pytest.approx(before["alpha"], abs=1e-5)


def test_adapter_loads_that_cannot_happen_change_nothing(lora_engine, adapters, tmp_path):
    before = out_logprobs(through(lora_engine, "beta"))
    # Without upsert a loaded name is refused (SGLang's rule).
    status, out = call(
        lora_engine + "/load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters["alpha"])}
    )
    assert status == 400 and "already loaded" in out["error_message"]
    # Not an adapter directory.
    status, out = call(
        lora_engine + "/load_lora_adapter", {"lora_name": "beta", "lora_path": str(tmp_path), "upsert": True}
    )
    assert status == 400 and "adapter_config.json" in out["error_message"]
    # An adapter directory whose weights do not load: the old adapter keeps serving.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapters["alpha"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    status, out = call(
        lora_engine + "/load_lora_adapter", {"lora_name": "beta", "lora_path": str(broken), "upsert": True}
    )
    assert status == 400 and "keeps serving" in out["error_message"]
    assert out_logprobs(through(lora_engine, "beta")) == before
    # The base of an engine serving adapters is fixed.
    status, out = call(lora_engine + "/update_weights_from_disk", {"model_path": str(adapters["alpha"])})
    assert status == 400 and "load_lora_adapter" in out["message"]


def test_load_and_unload_at_run_time(lora_engine, adapters):
    status, out = call(
        lora_engine + "/load_lora_adapter", {"lora_name": "gamma.v1", "lora_path": str(adapters["beta"])}
    )
    assert status == 200, out
    assert out_logprobs(through(lora_engine, "gamma.v1")) == out_logprobs(through(lora_engine, "beta"))
    status, out = call(lora_engine + "/unload_lora_adapter", {"lora_name": "gamma.v1"})
    assert status == 200 and "gamma.v1" not in out["loaded_adapters"]
    status, _ = call(
        lora_engine + "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "gamma.v1"}
    )
    assert status == 400
    status, out = call(lora_engine + "/unload_lora_adapter", {"lora_name": "gamma.v1"})
    assert status == 400 and "no LoRA adapter named" in out["error_message"]


def test_an_engine_without_adapters_refuses_lora_path(engine):
    status, out = call(engine.url + "/generate", {"input_ids": PROMPT, "lora_path": "alpha"})
    assert status == 400 and "--lora-paths" in out["error"]["message"]
    status, out = call(engine.url + "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"})
    assert status == 400 and "--enable-lora" in out["error_message"]


@pytest.mark.skipif(not router_available(), reason="sglang-router is not installed")
def test_the_router_passes_lora_path_through(lora_engine, logs_dir):
    router = start_router([lora_engine], log_dir=logs_dir, name="router-lora")
    try:
        direct = out_ids(through(lora_engine, "beta"))
        assert out_ids(through(router.url, "beta")) == direct
        assert out_ids(through(router.url, "alpha")) == out_ids(through(lora_engine, "alpha"))
        status, _ = call(
            router.url + "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "lora_path": "gamma"}
        )
        assert status == 400
    finally:
        router.stop()


def test_an_update_while_paused_in_place_aborts_only_that_adapters_rows(lora_engine, adapters):
    """Paused in place, rows stay in the batch across an update (as in SGLang): a row of the adapter
    replaced cannot go on with other weights than it started with, so it ends (abort); a row of
    another adapter resumes untouched."""
    long = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        alpha = pool.submit(through, lora_engine, "alpha", **long)
        beta = pool.submit(through, lora_engine, "beta", **long)
        wait_running(lora_engine, 2)
        assert call(lora_engine + "/pause_generation", {"mode": "in_place"})[0] == 200
        status, out = call(
            lora_engine + "/load_lora_adapter",
            {"lora_name": "alpha", "lora_path": str(adapters["alpha"]), "upsert": True},
        )
        assert status == 200, out
        assert call(lora_engine + "/continue_generation", {})[0] == 200
        stopped, kept = alpha.result(timeout=120), beta.result(timeout=120)
    assert stopped["meta_info"]["finish_reason"]["type"] == "abort"
    assert "'alpha' was updated" in stopped["meta_info"]["finish_reason"]["message"]
    assert kept["meta_info"]["finish_reason"] == {"type": "length", "length": 400}


def test_adapters_the_engine_cannot_serve_are_refused_and_leave_the_base_as_it_was(
    tiny_model_dir, adapters, logs_dir, tmp_path
):
    proc = start_engine(
        tiny_model_dir, log_dir=logs_dir, name="engine-lora-empty", threads=1, extra=["--enable-lora"]
    )
    try:
        base = out_logprobs(generate(proc.url, PROMPT, **GREEDY))
        # DoRA rows cannot share a batch with other rows: refused by name
        dora = tmp_path / "dora"
        dora.mkdir()
        config = (
            (adapters["alpha"] / "adapter_config.json")
            .read_text()
            .replace('"use_dora": false', '"use_dora": true')
        )
        assert '"use_dora": true' in config
        (dora / "adapter_config.json").write_text(config)
        status, out = call(proc.url + "/load_lora_adapter", {"lora_name": "d", "lora_path": str(dora)})
        assert status == 400 and "DoRA" in out["error_message"]
        # An adapter made for a base of other shapes fails half way through its first load; the
        # base must not keep the layers it got before the failure.
        other_base = ensure_model(tmp_path / "small", preset="small", seed=0)
        misfit = random_adapter(other_base, tmp_path / "misfit", 4)
        status, out = call(proc.url + "/load_lora_adapter", {"lora_name": "m", "lora_path": str(misfit)})
        assert status == 400 and "could not load" in out["error_message"], out
        assert out_logprobs(generate(proc.url, PROMPT, **GREEDY)) == base
        # and an adapter that fits loads after it
        status, out = call(
            proc.url + "/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["alpha"])}
        )
        assert status == 200 and out["loaded_adapters"] == {"a": str(adapters["alpha"])}, out
        assert out_logprobs(through(proc.url, None)) == base
        assert out_logprobs(through(proc.url, "a")) != base
    finally:
        proc.stop()


def adapter_copy(src: Path, out: Path, tensors: dict | None, **settings) -> Path:
    """Adapter directory `src` copied to `out` with `tensors` as its weights file (None: none) and
    `settings` changed in its adapter_config.json."""
    import json

    from safetensors.torch import save_file

    out.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **settings}))
    if tensors is not None:
        save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def load(url: str, name: str, path: Path, **extra) -> tuple[int, dict]:
    return call(url + "/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def unfitting_weights(case: str, good: dict, base_weights: dict) -> dict | None:
    """An adapter's `good` tensors spoilt as `case` says (None: no weights file)."""
    import torch

    if case == "empty file":
        return {}
    if case == "no weights file":
        return None
    if case == "renamed keys":
        return {k.replace(".lora_A.", ".lora_down."): v for k, v in good.items()}
    if case == "a layer missing":
        return {k: v for k, v in good.items() if ".layers.1." not in k}
    if case == "a module it does not target":
        return {**good, "base_model.model.model.layers.0.input_layernorm.lora_A.weight": torch.zeros(4, 32)}
    assert case == "base weights"  # which peft would write into the base model every row shares
    return {**good, "base_model.model.lm_head.weight": base_weights["lm_head.weight"] + 1.0}


@pytest.mark.parametrize(
    "case, named",
    [
        ("empty file", "28 of its 28 LoRA weights are missing"),
        ("no weights file", "no adapter_model.safetensors"),
        ("renamed keys", "model.layers.0.mlp.down_proj.lora_down.weight"),
        ("a layer missing", "model.layers.1."),
        ("a module it does not target", "model.layers.0.input_layernorm.lora_A.weight"),
        ("base weights", "lm_head.weight"),
    ],
)
def test_an_upsert_whose_weights_do_not_fit_the_adapter_is_refused_and_the_old_one_keeps_serving(
    lora_engine, adapters, tiny_model_dir, tmp_path, case, named
):
    """peft loads the tensors whose names match and leaves the rest as initialised (B = 0: that
    module computes what the base does) or writes them into the base model: such a load would
    serve another policy than the trainer pushed, under a new version, or change every row."""
    from safetensors.torch import load_file

    good = load_file(str(adapters["beta"] / "adapter_model.safetensors"))
    spoilt = unfitting_weights(case, good, load_file(str(tiny_model_dir / "model.safetensors")))
    broken = adapter_copy(adapters["beta"], tmp_path / "broken", spoilt)
    status, out = load(lora_engine, "delta", adapters["beta"])
    assert status == 200, out
    try:
        before = {n: through(lora_engine, n) for n in ("delta", "alpha", None)}
        status, out = load(lora_engine, "delta", broken, upsert=True, weight_version="9")
        assert status == 400, out
        message = out["error_message"]
        assert "'delta'" in message and str(broken) in message and named in message, message
        assert message.endswith("the old adapter keeps serving"), message
        # the old weights serve on at their version; the other adapter and the base are untouched
        for n, was in before.items():
            now = through(lora_engine, n)
            assert out_logprobs(now) == out_logprobs(was), n
            assert now["meta_info"]["weight_version"] == was["meta_info"]["weight_version"], n
        info = call(lora_engine + "/server_info")[1]["lora_adapters"]["delta"]
        assert info == {"lora_path": str(adapters["beta"]), "weight_version": "0"}
    finally:
        call(lora_engine + "/unload_lora_adapter", {"lora_name": "delta"})


def test_an_engine_does_not_start_with_an_adapter_whose_weights_do_not_fit(
    tiny_model_dir, adapters, logs_dir, tmp_path
):
    from safetensors.torch import load_file

    good = load_file(str(adapters["alpha"] / "adapter_model.safetensors"))
    partial = adapter_copy(
        adapters["alpha"], tmp_path / "partial", {k: v for k, v in good.items() if ".layers.1." not in k}
    )
    extra = ["--lora-paths", f"alpha={adapters['alpha']}", f"part={partial}"]
    try:
        proc = start_engine(
            tiny_model_dir, log_dir=logs_dir, name="engine-lora-partial", threads=1, extra=extra
        )
    except ProcessStartError as exc:
        message = str(exc)
    else:
        proc.stop()
        pytest.fail("the engine started, serving adapter 'part' without the weights of its layer 1")
    assert "'part'" in message and str(partial) in message and "model.layers.1." in message, message


# Settings that peft cannot serve row by row beside other adapters: each either fails every mixed
# batch, or changes the base model (and so every other row). Built with peft where it can.
UNMIXABLE = {
    "modules_to_save": {"modules_to_save": ["lm_head"]},
    "trainable_token_indices": {"trainable_token_indices": [5, 6]},
    "bias": {"bias": "all"},
    "layer_replication": {"layer_replication": [[0, 2], [1, 2]]},
    "init_lora_weights": {"init_lora_weights": "pissa"},
    "alora_invocation_tokens": {"alora_invocation_tokens": [20, 21]},
}
REWRITTEN = {  # written into a copy of an adapter's config
    "target_parameters": {"target_modules": None, "target_parameters": ["mlp.down_proj.weight"]},
    "kasa_config": {"kasa_config": {"kasa_mode": "svd"}},
    "arrow_config": {"arrow_config": {"top_k": 2}},
}


@pytest.mark.parametrize("field", [*UNMIXABLE, *REWRITTEN])
def test_adapters_that_cannot_share_a_batch_with_others_are_refused_by_name(
    lora_engine, tiny_model_dir, adapters, tmp_path, field
):
    from safetensors.torch import load_file

    if field in UNMIXABLE:
        odd = random_adapter(tiny_model_dir, tmp_path / field, 5, **UNMIXABLE[field])
    else:
        weights = load_file(str(adapters["alpha"] / "adapter_model.safetensors"))
        odd = adapter_copy(adapters["alpha"], tmp_path / field, weights, **REWRITTEN[field])
    before = {n: out_logprobs(through(lora_engine, n)) for n in ("alpha", "beta", None)}
    status, out = load(lora_engine, "odd", odd)
    try:
        # every other adapter and the base serve on as before
        for n, was in before.items():
            status_n, now = call(
                lora_engine + "/generate",
                {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "lora_path": n},
            )
            assert status_n == 200, now
            assert out_logprobs(now) == was, n
        assert status == 400, out
        message = out["error_message"]
        assert "'odd'" in message and field in message and "plain LoRA" in message, message
        assert "odd" not in call(lora_engine + "/server_info")[1]["lora_adapters"]
    finally:
        if status == 200:
            call(lora_engine + "/unload_lora_adapter", {"lora_name": "odd"})


def test_adapters_on_some_layers_or_with_other_scalings_share_batches(lora_engine, tiny_model_dir, tmp_path):
    """What peft mixes row by row loads: LoRA on some layers only, rsLoRA scaling, a LoRA bias."""
    some = random_adapter(tiny_model_dir, tmp_path / "some", 6, layers_to_transform=[0], use_rslora=True)
    biased = random_adapter(tiny_model_dir, tmp_path / "biased", 7, lora_bias=True)
    for name, path in (("some", some), ("biased", biased)):
        status, out = load(lora_engine, name, path)
        assert status == 200, out
    try:
        alone = {n: out_logprobs(through(lora_engine, n)) for n in ("some", "biased", "beta", None)}
        assert alone["some"] != alone[None] and alone["biased"] != alone[None]
        status, rows = call(
            lora_engine + "/generate",
            {
                "input_ids": [PROMPT] * 4,
                "sampling_params": GREEDY,
                "return_logprob": True,
                "lora_path": ["some", "biased", "beta", None],
            },
        )
        assert status == 200, rows
        for row, n in zip(rows, alone):
            assert out_logprobs(row) == pytest.approx(alone[n], abs=1e-5), n
    finally:
        for name in ("some", "biased"):
            call(lora_engine + "/unload_lora_adapter", {"lora_name": name})


def test_a_first_adapter_whose_weights_do_not_fit_leaves_the_base_as_it_was(
    tiny_model_dir, adapters, logs_dir, tmp_path
):
    """The first adapter turns the base into a peft model: a refused one must leave no layer behind."""
    from safetensors.torch import load_file

    good = load_file(str(adapters["alpha"] / "adapter_model.safetensors"))
    partial = adapter_copy(
        adapters["alpha"], tmp_path / "partial", {k: v for k, v in good.items() if "lora_B" not in k}
    )
    proc = start_engine(
        tiny_model_dir, log_dir=logs_dir, name="engine-lora-first", threads=1, extra=["--enable-lora"]
    )
    try:
        base = out_logprobs(generate(proc.url, PROMPT, **GREEDY))
        status, out = load(proc.url, "a", partial)
        assert status == 400 and "14 of its 28 LoRA weights are missing" in out["error_message"], out
        assert call(proc.url + "/server_info")[1]["lora_adapters"] == {}
        assert out_logprobs(generate(proc.url, PROMPT, **GREEDY)) == base
        status, out = load(proc.url, "a", adapters["alpha"])
        assert status == 200, out
        assert out_logprobs(through(proc.url, None)) == base
        assert out_logprobs(through(proc.url, "a")) != base
    finally:
        proc.stop()
