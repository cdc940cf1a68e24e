"""Hugging Face DeepSeek-V3 in and out: transformers' DeepseekV3ForCausalLM logits on one device and on
an expert- and tensor-parallel mesh (and through the decoding cache), the export bit for bit under
HF's names, and what jaxpar does not compute refused in one line.

The fixtures (tests/fixtures/hf_deepseek_*, made by scripts/fixtures/hf_fixtures.py make --family deepseek with
transformers 5.24) are random models with vocab 101 whose routers, with a non-zero correction bias,
send tokens to every expert: one with a query bottleneck, 8 routed experts in 4 groups and a dense
first layer in float32; one without the bottleneck, 4 experts in 2 groups, tied, in bfloat16; one
with YaRN rope scaling (factor 4 over 16 original positions, 32 fed).
Tolerance: logits within rtol 1e-5 plus atol 1e-5 of transformers' float32 ones (of order 1 to 5).
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import tiny_config
from helpers import cached_logits, copy_with, exported_configs, logits_of, tensors_of
from helpers import placed as placed_on

from jaxpar.core.errors import UserError
from jaxpar.inference import export
from jaxpar.models import hf
from jaxpar.models.decode import empty_cache
from jaxpar.models.transformer import build_model
from jaxpar.sample import main as sample_main
from jaxpar.train import run

FIXTURES = Path(__file__).parent / "fixtures"
V3, V3_BF16, V3_YARN = (FIXTURES / name for name in ("hf_deepseek_v3", "hf_deepseek_v3_bf16", "hf_deepseek_v3_yarn"))
RTOL = ATOL = 1e-5


@pytest.mark.parametrize("hf_dir, spec", [(V3, "dp=1"), (V3, "ep=2,tp=2"), (V3_BF16, "dp=1"), (V3_YARN, "dp=1")])
def test_hf_deepseek_gives_transformers_logits(hf_dir, spec):
    cfg, vocab, mesh, shardings = placed_on(spec, 0, hf_dir)
    m = cfg.model
    assert (m.family, m.q_lora_rank, m.n_experts, m.dense_layers, m.rope_type, m.mtp_layers) == \
        {V3: ("deepseek", 16, 8, "0", "default", 0), V3_BF16: ("deepseek", 0, 4, "0", "default", 0),
         V3_YARN: ("deepseek", 16, 4, "0", "yarn", 0)}[hf_dir]  # num_nextn_predict_layers 1, no weights
    params = hf.load_hf_params(hf_dir, cfg.model, vocab, shardings)
    assert np.abs(np.asarray(params["blocks"]["router"]["balance"])).max() > 0.01  # the correction bias read
    ids, expected = np.load(hf_dir / "input_ids.npy"), np.load(hf_dir / "logits.npy")
    np.testing.assert_allclose(logits_of(cfg, vocab, mesh, params, ids), expected, RTOL, ATOL)
    if hf_dir == V3 and spec == "dp=1":  # the latent cache: the rest after 9 tokens went into it
        np.testing.assert_allclose(cached_logits(cfg, vocab, mesh, params, ids, 9), expected[:, 9:], RTOL, ATOL)
        # Controls: the rotated dims taken as halves, or the correction bias left out of the choice.
        cfg.model.rope_interleave = False
        assert np.abs(logits_of(cfg, vocab, mesh, params, ids) - expected).max() > 100 * ATOL
        cfg.model.rope_interleave = True
        unbiased = jax.tree.map(lambda a: a, params)
        unbiased["blocks"]["router"]["balance"] = 0 * params["blocks"]["router"]["balance"]
        assert np.abs(logits_of(cfg, vocab, mesh, unbiased, ids) - expected).max() > 100 * ATOL
    if hf_dir == V3_YARN:  # Control: YaRN's frequencies without its scaling of the scores
        cfg.model.rope_mscale_all_dim = 0.0
        assert np.abs(logits_of(cfg, vocab, mesh, params, ids) - expected).max() > 100 * ATOL


@pytest.mark.parametrize("hf_dir", [V3, V3_BF16, V3_YARN])
def test_export_is_what_save_pretrained_writes(hf_dir):
    config, written = exported_configs(hf_dir)
    for key, value in config.items():
        if key not in ("dtype", "initializer_range", "transformers_version", "num_nextn_predict_layers"):  # MTP: 0
            assert written[key] == value, key


@pytest.mark.parametrize("change, expected", [
    ({"quantization_config": {"quant_method": "fp8"}}, "has quantized weights (quantization_config)"),
    ({"scoring_func": "softmax"}, "has softmax routing by None"),
    ({"num_key_value_heads": 2}, "has num_key_value_heads=2 unlike num_attention_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 40, "attention_factor": 1.2}},
     "has YaRN with attention_factor"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2}}, "has rope type 'dynamic'"),
    ({"n_group": 3}, "model.n_group=3 must divide model.n_experts=8"),
])
def test_what_jaxpar_does_not_compute_is_one_line(tmp_path, change, expected):
    with pytest.raises(UserError) as error:
        placed_on("dp=1", 0, copy_with(tmp_path, V3, change))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_the_export_of_a_trained_deepseek_samples_its_text(tmp_path, capsys):
    """tiny_deepseek after 2 steps (its balance biases moved, one MTP module): the export holds the
    module as layer 2 (DeepSeek's place) and reads back as the run's, bit for bit; sampling it with
    --hf on ep=2 gives the run's greedy text, as the run's checkpoint does with its latent cache
    and without a cache."""
    trained = run(tiny_config("tiny_deepseek", **{"train.steps": 2, "train.eval_every": 0}), tmp_path / "run",
                  jax.devices()[:1], progress=False).params
    export.export(tmp_path / "run", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["num_nextn_predict_layers"]) == (["DeepseekV3ForCausalLM"], 1)
    names = tensors_of(tmp_path / "hf")
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.mlp.experts.7.down_proj.weight",
            "model.layers.2.shared_head.head.weight"} <= set(names)
    assert np.abs(names["model.layers.1.mlp.gate.e_score_correction_bias"]).max() > 0
    cfg, vocab, _, shardings = placed_on("dp=1", 0, tmp_path / "hf")
    assert cfg.model.mtp_layers == 1
    read = hf.load_hf_params(tmp_path / "hf", cfg.model, vocab, shardings)
    jax.tree.map(np.testing.assert_array_equal, read["mtp"], trained["mtp"])
    # the control: the module's block is not the main model's last layer
    assert not np.array_equal(read["mtp"]["block"]["attn_out"]["kernel"][0], read["blocks"]["attn_out"]["kernel"][-1])
    with pytest.raises(UserError, match="says num_nextn_predict_layers=2, and its weights hold 1 modules"):
        placed_on("dp=1", 0, copy_with(tmp_path / "two", tmp_path / "hf", {"num_nextn_predict_layers": 2}))
    greedy = ["--temperature", "0", "--prompt", "ROMEO:", "--max-new-tokens", "12"]
    texts = []
    for source in (["--ckpt", str(tmp_path / "run")], ["--ckpt", str(tmp_path / "run"), "--no-cache"],
                   ["--hf", str(tmp_path / "hf"), "--mesh", "ep=2"]):
        sample_main(source + greedy)
        texts.append(capsys.readouterr().out)
    assert texts[0].startswith("ROMEO:") and texts[0] == texts[1] == texts[2]


def test_decoding_caches_the_latent():
    """tiny_deepseek's cache holds a token's 16-wide latent and 4-wide rotated key in each of its
    2 layers, float32: 160 bytes a token, where each head's key and value would be 4 x (12 + 8)."""
    from jaxpar.models.decode import cache_bytes_per_token
    model = build_model(tiny_config("tiny_deepseek"), 65)
    cache = empty_cache(model, 3)
    assert (cache.k.shape, cache.v.shape) == ((2, 3, 1, 32, 16), (2, 3, 1, 32, 4))
    assert cache_bytes_per_token(model) == 2 * (16 + 4) * 4 == 160
