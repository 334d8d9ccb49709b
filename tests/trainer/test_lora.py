"""LoRA adapters on the policy (spec.model.lora, rft_trainer.lora) in one process, against
PEFT and transformers themselves: the reference policy is the base model, each exported
version is the base with the adapters merged the way PEFT merges them, and target modules
that name nothing (or no linear layer) are refused by field. 1 against 2 ranks and
checkpoints: test_fsdp.py and test_checkpoint.py."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from rft_contract.config import load_config
from rft_contract.spec import LoraSpec
from rft_contract.storage import LocalStorage
from rft_trainer import lora
from rft_trainer.engine import FSDPTrainEngine
from rft_trainer.export import ADAPTER_FORMAT, export_adapter, export_hf
from rft_trainer.roles import token_logprobs
from tests.fixtures.batches import synthetic_batch
from tests.fixtures.models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def prepared(tiny, rt, dtype: str = "fp32", lr: float = 1e-2, inference: dict | None = None,
             **lora_spec) -> FSDPTrainEngine:
    config = load_config({**({"inference": inference} if inference else {}),
        "model": {"path": str(tiny), "dtype": dtype, "lora": {"rank": 4, "alpha": 8, **lora_spec}},
        "algorithm": {"name": "grpo", "learning_rate": lr, "kl_coef": 0.01, "micro_batch_size": 4,
                      "mini_batch_size": 8, "epochs": 1},
        "trainer": {"total_steps": 10, "batch_size": 8, "fsdp": {"mixed_precision": "fp32"}},
        "checkpoint": {"uri": "s3://unused/x"},
    })
    engine = FSDPTrainEngine(config, rt)
    engine.prepare()
    return engine


def trained(tiny, rt, steps: int = 2, **kw) -> tuple[FSDPTrainEngine, object]:
    engine = prepared(tiny, rt, **kw)
    batch = synthetic_batch(8, prompt_len=4, response_len=6, vocab=24, group_size=4, seed=1)
    for _ in range(steps):
        engine.train_step(batch)
    return engine, batch


def test_the_reference_is_the_base_model_and_the_adapters_train_on(tiny, world_of_one):
    from transformers import AutoModelForCausalLM

    engine, batch = trained(tiny, world_of_one)
    assert engine.ref.model is engine.actor.model  # no second copy of the weights
    base = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    with torch.no_grad():
        want, _ = token_logprobs(base(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits, batch.tokens)
    ref = engine.ref.compute_ref_log_prob(batch)
    assert (ref - want).abs().max().item() < 1e-5
    policy, _ = engine.actor.compute_log_prob(batch)
    assert (policy - want).abs().max().item() > 1e-3  # the adapters changed the policy
    # The adapters are trainable again after the reference's pass, the base never.
    named = dict(engine.actor.model.named_parameters())
    assert all(p.requires_grad == lora.is_adapter_key(n) for n, p in named.items())
    assert sum(p.numel() for p in engine.actor.optimizer.param_groups[0]["params"]) + sum(
        p.numel() for g in engine.actor.optimizer.param_groups[1:] for p in g["params"]) == sum(
        p.numel() for n, p in named.items() if lora.is_adapter_key(n))


def test_each_version_is_the_base_with_the_adapters_merged_as_peft_merges_them(tiny, world_of_one, tmp_path):
    from transformers import AutoModelForCausalLM

    engine, batch = trained(tiny, world_of_one)
    model = engine.actor.model
    manifest = export_hf(model, world_of_one, LocalStorage(), str(tmp_path / "v2"), str(tiny), 2, dtype="fp32")
    exported = load_file(str(tmp_path / "v2" / "model-00001.safetensors"))
    assert exported.keys() == load_file(str(tiny / "model.safetensors")).keys()  # the base's names, no adapters
    # PEFT's own merge (lora.Linear.merge: W += B A * scaling) of a copy of the live model.
    peft_merged = copy.deepcopy(model)
    for layer in lora.layers(peft_merged).values():
        layer.merge()
    want = {lora.hf_name(k): v for k, v in peft_merged.state_dict().items() if not lora.is_adapter_key(k)}
    worst = max((exported[k] - want[k]).abs().max().item() for k in exported)
    assert worst < 1e-6, worst
    assert any(not torch.equal(exported[k], v) for k, v in load_file(str(tiny / "model.safetensors")).items())
    # And the export is a plain HF model that computes what the trainer's policy does.
    served = AutoModelForCausalLM.from_pretrained(str(tmp_path / "v2")).eval()
    with torch.no_grad():
        got, _ = token_logprobs(served(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits, batch.tokens)
    policy, _ = engine.actor.compute_log_prob(batch)
    assert (got - policy).abs().max().item() < 1e-5
    assert manifest["format"] == "hf-safetensors"


def test_an_adapter_version_is_peft_s_format_and_peft_on_the_base_computes_the_trainer_s_policy(
        tiny, world_of_one, tmp_path):
    """The adapter-only version (engines that load adapters): PeftModel.from_pretrained on
    the base model reads it and computes the trainer's log-probs; the fingerprint covers
    exactly the file's tensors; and it is a small fraction of the merged version."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine, batch = trained(tiny, world_of_one)
    model = engine.actor.model
    spec = engine.config.model.lora
    manifest = export_adapter(model, world_of_one, LocalStorage(), str(tmp_path / "v2"), spec, str(tiny), 2,
                              dtype="fp32", extra_files={"probe.json": b"{}"})
    assert manifest["format"] == ADAPTER_FORMAT
    assert sorted(manifest["files"]) == ["adapter_config.json", "adapter_model.safetensors", "fingerprint.json",
                                         "probe.json"]
    tensors = load_file(str(tmp_path / "v2" / "adapter_model.safetensors"))
    assert len(tensors) == 2 * len(lora.layers(model)) and all(lora.is_adapter_key(k) for k in tensors)
    fingerprint = json.loads((tmp_path / "v2" / "fingerprint.json").read_text())
    assert fingerprint["params"].keys() == tensors.keys()
    config = json.loads((tmp_path / "v2" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]  # all-linear as resolved on this model
    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(tmp_path / "v2")).eval()
    with torch.no_grad():
        got, _ = token_logprobs(served(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits,
                                batch.tokens)
    policy, _ = engine.actor.compute_log_prob(batch)
    assert (got - policy).abs().max().item() < 1e-5
    base = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    with torch.no_grad():
        unadapted, _ = token_logprobs(base(input_ids=batch.tokens, attention_mask=batch.attention_mask.long()).logits,
                                      batch.tokens)
    assert (got - unadapted).abs().max().item() > 1e-3  # the adapter is in what PEFT serves
    merged = export_hf(model, world_of_one, LocalStorage(), str(tmp_path / "m2"), str(tiny), 2, dtype="fp32")
    assert manifest["bytes"] < merged["bytes"] / 4, (manifest["bytes"], merged["bytes"])


def test_a_lora_job_syncs_the_adapter_alone_when_its_engine_loads_adapters(tiny, world_of_one):
    assert prepared(tiny, world_of_one, inference={"engine": "reference"}).adapter_versions
    assert prepared(tiny, world_of_one, inference={"engine": "vllm", "image": "vllm/vllm-openai:v0.32.0"}
                    ).adapter_versions  # vLLM loads them at run time (tests/trainer/test_vllm_lora.py)
    assert not prepared(tiny, world_of_one, inference={"engine": "sglang", "image": "lmsysorg/sglang:v0.5.23"}
                        ).adapter_versions  # merged: SGLang's adapter routes are not driven yet
    assert not prepared(tiny, world_of_one).adapter_versions  # no engines: a plain HF model


def test_a_job_starts_from_the_adapter_at_adapter_path(tiny, world_of_one, tmp_path):
    """spec.model.lora.adapterPath: a new job's policy is the base with that adapter (here
    one this trainer exported after two steps, as PEFT saves it), its reference the base."""
    trained_engine, batch = trained(tiny, world_of_one)
    export_adapter(trained_engine.actor.model, world_of_one, LocalStorage(), str(tmp_path / "a"),
                   trained_engine.config.model.lora, str(tiny), 2, dtype="fp32")
    want, _ = trained_engine.actor.compute_log_prob(batch)
    base = trained_engine.ref.compute_ref_log_prob(batch)
    started = prepared(tiny, world_of_one, adapter_path=str(tmp_path / "a"))
    got, _ = started.actor.compute_log_prob(batch)
    assert (got - want).abs().max().item() < 1e-6
    assert (started.ref.compute_ref_log_prob(batch) - base).abs().max().item() < 1e-6
    fresh, _ = prepared(tiny, world_of_one).actor.compute_log_prob(batch)
    assert (fresh - want).abs().max().item() > 1e-3  # not the zero adapter of a new job


@pytest.mark.parametrize("spec, says", [
    ({"rank": 8, "alpha": 16}, "rank 4 and alpha 8.0 are not spec.model.lora's (8, 16)"),
    ({"target_modules": ["q_proj", "v_proj"]}, "adapts what spec.model.lora.targetModules does not"),
    ({"target_modules": ["q_proj", "v_proj"], "_keep": ".q_proj."}, "no adapter for 2 layers"),  # v_proj x 2
    ({"_config": {"use_rslora": True}}, "sets use_rslora, which the trainer's LoRA does not"),
    ({"_config": {"alpha_pattern": {"q_proj": 4}}}, "sets alpha_pattern"),
])
def test_a_starting_adapter_that_does_not_fit_the_spec_is_refused_naming_the_field(tiny, world_of_one, tmp_path,
                                                                                  spec, says):
    from safetensors.torch import save_file

    engine = prepared(tiny, world_of_one)
    export_adapter(engine.actor.model, world_of_one, LocalStorage(), str(tmp_path / "a"), engine.config.model.lora,
                   str(tiny), 1, dtype="fp32")
    spec = dict(spec)
    if changes := spec.pop("_config", None):  # PEFT settings the trainer does not train with
        import json

        config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
        (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    if keep := spec.pop("_keep", None):  # an adapter of fewer layers than the spec's
        tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
        save_file({k: v for k, v in tensors.items() if keep in k}, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="spec.model.lora.adapterPath") as e:
        prepared(tiny, world_of_one, adapter_path=str(tmp_path / "a"), **spec)
    assert says in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def tiny_llama_tied(tmp_path_factory):
    from tests.fixtures.architectures import save_tiny

    return save_tiny("llama", tmp_path_factory.mktemp("llama") / "model", tie=True)


@pytest.mark.parametrize("targets, says", [
    (["no_such_proj"], "spec.model.lora.targetModules ['no_such_proj']"),
    (["q_proj", "v_porj"], "spec.model.lora.targetModules ['q_proj', 'v_porj']: v_porj matched no linear layer"),
    (["embed_tokens"], "not linear layers: model.embed_tokens"),
    (["lm_head"], "adapt lm_head, whose weight is tied to another"),
])
def test_target_modules_that_name_no_linear_layer_or_a_tied_one_are_refused_by_field(tiny_llama_tied, targets, says):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_tied))
    with pytest.raises(ValueError) as e:
        lora.inject(model, LoraSpec(rank=4, target_modules=targets))
    assert says in str(e.value)


def test_a_layer_stored_in_by_out_merges_transposed_as_peft_does(tmp_path):
    """GPT-2's Conv1D layers keep their weight (in, out): PEFT's delta is (B A)^T there."""
    from tests.fixtures.architectures import save_tiny
    from transformers import AutoModelForCausalLM

    model = lora.inject(AutoModelForCausalLM.from_pretrained(str(save_tiny("gpt2", tmp_path / "gpt2"))),
                        LoraSpec(rank=4, alpha=8))
    assert any(m.fan_in_fan_out for m in lora.layers(model).values())
    torch.manual_seed(0)
    with torch.no_grad():
        for m in lora.layers(model).values():
            m.lora_B[lora.ADAPTER].weight.normal_()  # PEFT starts B at zero: no delta to see
    got = dict(lora.merged(model, model.state_dict().items()))
    peft_merged = copy.deepcopy(model)
    for layer in lora.layers(peft_merged).values():
        layer.merge()
    want = {lora.hf_name(k): v for k, v in peft_merged.state_dict().items() if not lora.is_adapter_key(k)}
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in got) < 1e-5


def test_a_checkpoint_of_a_tied_model_holds_the_adapters_alone(tiny_llama_tied, world_of_one):
    """Tied embeddings: `ignore_frozen_params` drops the frozen embedding but not the head's
    alias of it (the embedding matrix again, 2/3 of SmolLM2-135M's LoRA checkpoint)."""
    from rft_trainer.checkpoint import AppState

    engine, _ = trained(tiny_llama_tied, world_of_one, steps=1)
    saved = AppState({"actor": engine.actor}).state_dict()["actor"]
    assert saved["model"] and all(lora.is_adapter_key(k) for k in saved["model"]), sorted(saved["model"])[:4]
    assert len(saved["optim"]["state"]) == len(saved["model"])


def test_named_target_modules_adapt_those_layers_only(tiny):
    from transformers import AutoModelForCausalLM

    model = lora.inject(AutoModelForCausalLM.from_pretrained(str(tiny)), LoraSpec(rank=2, target_modules=["q_proj", "v_proj"]))
    assert sorted(lora.layers(model)) == [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("q_proj", "v_proj")]


def test_bf16_master_weights_at_lr_1e_5_train_the_adapters_and_every_version_shows_it(tiny, world_of_one, tmp_path):
    """At the settings users run (bf16 master weights, lr 1e-5) the adapters train: they
    are kept in fp32 (as PEFT's PeftModel keeps them), so every A moves after one step
    and every B leaves zero; and the merged bf16 version differs from the base in every
    adapted weight, so the replicas' exact check (the fingerprint) tells it from the
    version before."""
    engine = prepared(tiny, world_of_one, dtype="bf16", lr=1e-5, rank=8, alpha=16)
    before = {k: v.clone() for k, v in engine.actor.model.state_dict().items() if ".lora_A." in k}
    engine.train_step(synthetic_batch(8, prompt_len=4, response_len=6, vocab=24, group_size=4, seed=1))
    state = engine.actor.model.state_dict()
    # The base in bf16, the adapters in fp32: a step of 1e-5 would round away in bf16's A.
    assert {v.dtype for k, v in state.items() if lora.is_adapter_key(k)} == {torch.float32}
    assert {v.dtype for k, v in state.items() if not lora.is_adapter_key(k)} == {torch.bfloat16}
    assert all(state[k].abs().max().item() > 0 for k in state if ".lora_B." in k)
    assert all(not torch.equal(state[k], v) for k, v in before.items())
    export_hf(engine.actor.model, world_of_one, LocalStorage(), str(tmp_path / "v1"), str(tiny), 1, dtype="bf16")
    exported = load_file(str(tmp_path / "v1" / "model-00001.safetensors"))
    base = load_file(str(tiny / "model.safetensors"))
    adapted = [f"{name}.weight" for name in lora.layers(engine.actor.model)]
    assert [k for k in adapted if torch.equal(exported[k], base[k].to(torch.bfloat16))] == []


def test_the_sync_agent_s_zero_adapter_is_the_base_exactly_and_names_a_layer_the_targets_match(tiny, tmp_path):
    """Version 0 of a LoRA job on vLLM (which serves the policy only as an adapter, and
    refuses one without tensors): the sidecar writes it without torch, one pair of zeros
    on a targeted layer. PEFT loads it and computes exactly the base's outputs."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rft_serving.sync_agent import write_zero_adapter

    out = write_zero_adapter(tmp_path / "zero", {"rank": 8, "alpha": 16, "targetModules": ["all-linear"]}, str(tiny))
    tensors = load_file(out / "adapter_model.safetensors")
    # An attention projection (every engine adapts those), its shapes from the base's header.
    assert sorted(tensors) == ["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight",
                               "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"]
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"].shape == (8, 64)
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (32, 8)
    ids = torch.tensor([[3, 7, 1, 9, 4]])
    base = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    with torch.no_grad():
        want = base(input_ids=ids).logits
        got = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny)), str(out)).eval()(
            input_ids=ids).logits
    assert torch.equal(got, want)
    named = write_zero_adapter(tmp_path / "named", {"rank": 4, "targetModules": ["v_proj"]}, str(tiny))
    assert sorted(load_file(named / "adapter_model.safetensors"))[0].endswith("layers.0.self_attn.v_proj.lora_A.weight")
    with pytest.raises(ValueError, match=r"spec.model.lora.targetModules \['w_proj'\]"):
        write_zero_adapter(tmp_path / "none", {"rank": 4, "targetModules": ["w_proj"]}, str(tiny))


def test_an_inference_pod_that_starts_on_an_adapter_version_starts_its_engine_from_the_base(tiny, tmp_path):
    """The init container (`--fetch-only`) of a pod that starts while the target is an
    adapter version (vLLM, mid-run): the engine's `initial` link is the base, fetched from
    spec.model.path; the sidecar then loads the adapter onto it. The agent never points the
    link at an adapter."""
    from rft_serving.engines import VLLMEngine
    from rft_serving.sync_agent import INITIAL_LINK, SyncAgent, fetch_only, write_zero_adapter
    from tests.trainer.test_engines import FakeJobApi

    adapter = write_zero_adapter(tmp_path / "export-v7", {"rank": 4}, str(tiny))  # stands for version 7's export
    api = FakeJobApi()
    agent = SyncAgent("job", "ns", "job-inference-0", VLLMEngine("http://127.0.0.1:9"), tmp_path / "dest", api=api)
    agent._watch = lambda: None  # the job as its watch would report it:
    agent._update({"spec": {"model": {"path": str(tiny), "lora": {"rank": 4}}},
                   "status": {"weightSync": {"target": {"version": 7, "id": "x7", "uri": str(adapter)}}}})
    out = tmp_path / "dest" / INITIAL_LINK
    assert fetch_only(agent, out, timeout=5) == 0
    assert out.is_symlink() and (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
    agent._link_initial(adapter)
    assert not (out / "adapter_config.json").exists()
