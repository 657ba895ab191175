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
from mrlx_plugin.local.processes import router_available, start_engine, start_router

PROMPT = [1, 74, 75, 20, 21, 9]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def random_adapter(base_dir: Path, out: Path, seed: int) -> Path:
    """A peft LoRA adapter on `base_dir` whose B matrices are random, so it changes the outputs."""
    import torch
    from peft import LoraConfig, get_peft_model

    from mrlx_plugin.local.model import load_model

    torch.manual_seed(seed)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(load_model(base_dir), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
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
