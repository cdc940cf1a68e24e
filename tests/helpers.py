"""Helpers shared by the test modules: the equivalence runs and their comparison, the one-line
error check, the multi-process launcher, a stand-in tiktoken encoding and the model's forward.

One-device reference runs are cached per test process (pytest-xdist runs each file in one), so
files on the same worker share them.
"""

import contextlib
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config

from jaxpar.data.tokenizer import EOT, TiktokenTokenizer
from jaxpar.models import hf
from jaxpar.models.transformer import build_model
from jaxpar.parallel.mesh import build_mesh
from jaxpar.train import main as train_main
from jaxpar.train import run
from jaxpar.training.step.build import build

STEPS = 10
LOSS_RTOL = 1e-5
PARAM_TOL = 1e-5  # relative to each tensor's largest magnitude


def train(spec: str = "dp=1", evaluate: bool = False, config: str = "tiny", **overrides):
    """STEPS of the tiny config (or another named one) on `spec`. Evaluation is off unless asked:
    most comparisons are of training, and those that evaluate compare the val losses too.
    One-device runs are shared."""
    overrides = {"train.steps": STEPS, "train.eval_every": 5 if evaluate else 0, **overrides}
    if spec == "dp=1":
        if str(overrides.get("train.zero", 0)) in ("0", "1", "2"):  # the same program on one device
            overrides["train.zero"] = 0
        return one_device_run(config, tuple(sorted((k, str(v)) for k, v in overrides.items())))
    cfg = tiny_config(config, **mesh_overrides(spec), **overrides)
    return run(cfg, devices=jax.devices()[:math.prod(cfg.mesh.__dict__.values())], progress=False)


@functools.cache
def one_device_run(config: str, overrides: tuple):
    """A reference run, once per test process (train() keys ZeRO 0-2 as 0: one program on one device)."""
    return run(tiny_config(config, **dict(overrides)), devices=jax.devices()[:1], progress=False)


def losses(result) -> np.ndarray:
    return np.array([result.losses[s] for s in range(STEPS)])


def error_at_scale(actual, desired) -> float:
    """The largest difference, as a fraction of `desired`'s largest magnitude: float32 sums are
    accurate to the size of their terms, so an entry that cancels near zero is held to the
    tensor's scale, not its own."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    return float(np.max(np.abs(actual - desired)) / max(np.max(np.abs(desired)), np.finfo(np.float32).tiny))


def param_errors(result, reference) -> dict[str, float]:
    """Each param's error_at_scale against the reference's."""
    return {jax.tree_util.keystr(path): err for path, err in jax.tree_util.tree_leaves_with_path(
        jax.tree.map(error_at_scale, result.params, reference.params))}


def assert_same_training(result, reference, param_tol=lambda path: PARAM_TOL):
    """The losses and val losses at LOSS_RTOL; each param within `param_tol(its path)` of the
    reference tensor's largest magnitude."""
    np.testing.assert_allclose(losses(result), losses(reference), rtol=LOSS_RTOL)
    assert result.val_losses.keys() == reference.val_losses.keys()
    np.testing.assert_allclose(list(result.val_losses.values()), list(reference.val_losses.values()),
                               rtol=LOSS_RTOL)
    worst = {k: e for k, e in param_errors(result, reference).items() if e > param_tol(k)}
    assert not worst, f"params differ beyond {[param_tol(k) for k in worst]} of their max magnitude: {worst}"


def exits_with_one_line(capsys, program: str, call, *expected: str) -> str:
    """call() exits 2 with one line on stderr, `program: error: ...`, holding each of `expected`."""
    with pytest.raises(SystemExit) as exit_info:
        call()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"{program}: error: ")
    for text in expected:
        assert text in err, err
    return err


def fails_with(capsys, tmp_path, argv: list[str], *expected: str):
    out = tmp_path / "run"
    exits_with_one_line(capsys, "jaxpar.train", lambda: train_main(argv + ["--out", str(out)]), *expected)
    assert not out.exists(), "a failed run must write nothing"


LAUNCH = Path(__file__).resolve().parent.parent / "scripts" / "tools" / "launch_local.sh"
LAUNCH_TIMEOUT_S = 300


def launch(out: Path, *train_args: str, background: bool = False, devices_per_process: int = 2):
    command = ["bash", str(LAUNCH), "2", str(devices_per_process), "--", "--config", "tiny", "--out", str(out),
               *train_args]
    env = {**os.environ, "PYTHON": sys.executable}
    if background:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def logged_values(out: Path, name: str) -> dict[int, float]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[name] for r in lines if name in r}


def logged_losses(out: Path) -> dict[int, float]:
    return logged_values(out, "loss")


def fake_tiktoken(monkeypatch):
    """A small byte-level tiktoken encoding under the name gpt2: tiktoken's real files need a
    download, which the tests may not do."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {bytes([b]): b for b in range(256)} | {b"th": 256, b"he": 257, b"the": 258}
    pattern = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    encoding = tiktoken.Encoding("gpt2", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens={EOT: 259})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: encoding)
    return TiktokenTokenizer("gpt2")


def logits_of(cfg, vocab, mesh, params, ids) -> np.ndarray:
    """The model's logits over the real vocabulary, computed on `mesh`."""
    model = build_model(cfg, vocab)
    with jax.set_mesh(mesh):
        logits = jax.jit(model)(params, ids)
    return np.asarray(logits)[..., :vocab]


def cached_logits(cfg, vocab, mesh, params, ids, split: int | None = None) -> np.ndarray:
    """The decoding forward pass's logits over the real vocabulary, computed on `mesh`: of every
    position at once through an empty cache, or with `split`, of positions split.. after the
    first split went into the cache."""
    from jaxpar.models.decode import empty_cache, forward
    model = build_model(cfg, vocab)
    with jax.set_mesh(mesh):
        decode = jax.jit(lambda p, t, c, pos: forward(model, p, t, c, pos), static_argnums=3)
        if split is None:
            logits, _ = decode(params, ids, empty_cache(model, ids.shape[0]), 0)
        else:
            _, cache = decode(params, ids[:, :split], empty_cache(model, ids.shape[0]), 0)
            logits, _ = decode(params, ids[:, split:], cache, split)
    return np.asarray(logits)[..., :vocab]


def tensors_of(hf_dir: Path) -> dict:
    """Every tensor of an HF directory's safetensors files, by name."""
    from safetensors import safe_open
    out = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(file, framework="numpy") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    return out


def exported_configs(hf_dir: Path) -> tuple[dict, dict]:
    """Load hf_dir and export it: every tensor must be the fixture's, bit for bit, under the same
    name (bf16 -> float32 master weights -> bf16 is exact); (the fixture's config.json, jaxpar's)."""
    cfg, vocab, _, shardings = placed("dp=1", 0, hf_dir)
    params = hf.load_hf_params(hf_dir, cfg.model, vocab, shardings)
    original = tensors_of(hf_dir)
    exported = hf.hf_state_dict(params, cfg.model, vocab, dtype=original["model.norm.weight"].dtype)
    assert sorted(exported) == sorted(original)
    for name, array in original.items():
        assert exported[name].dtype == array.dtype and np.array_equal(exported[name], array), name
    return json.loads((hf_dir / "config.json").read_text()), hf.hf_config(cfg.model, vocab, eot_id=0)


def copy_with(tmp_path: Path, hf_dir: Path, change: dict) -> Path:
    """A copy of hf_dir in tmp_path whose config.json has `change`."""
    import shutil
    out = tmp_path / "hf"
    shutil.copytree(hf_dir, out)
    (out / "config.json").write_text(json.dumps(json.loads((hf_dir / "config.json").read_text()) | change))
    return out


def placed(spec: str, zero: int, hf_dir: Path, **overrides):
    """(cfg, vocab_size, mesh, param shardings) for the model in hf_dir on the mesh `spec`."""
    cfg = tiny_config(**mesh_overrides(spec), **{"train.zero": zero}, **overrides)
    vocab = hf.apply_hf_config(cfg, hf_dir, {})
    mesh = build_mesh(cfg, jax.devices()[:math.prod(cfg.mesh.__dict__.values())])
    return cfg, vocab, mesh, build(cfg, mesh, vocab=vocab).shardings.params


def save_random_gpt2(run_dir: Path, cfg, tokenizer, step: int, scale: float):
    """A checkpoint in run_dir of a GPT-2 with params drawn N(0, scale^2) (seed 0), its norms'
    scales moved to 1 + N(0, scale^2): a model whose logits are far from uniform."""
    from jaxpar.models.transformer import abstract_model
    from jaxpar.training.checkpoints.checkpoint import CHECKPOINTS, Checkpoints, make_meta
    _, shapes, _ = abstract_model(cfg, tokenizer.vocab_size)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: scale * rng.standard_normal(s.shape, np.float32), shapes)
    for norm in (params["blocks"]["ln_1"], params["blocks"]["ln_2"], params["ln_f"]):
        norm["scale"] += 1.0
    checkpoints = Checkpoints(Path(run_dir) / CHECKPOINTS)
    checkpoints.save(step, params, {"left_out": np.zeros(())}, make_meta(cfg, tokenizer, step))
    checkpoints.wait()
    checkpoints.close()


def hf_dir_with(tmp_path: Path, fixture: Path, **changes) -> Path:
    """The fixture's directory with config.json's fields changed; the weights are links."""
    out = tmp_path / "hf"
    out.mkdir()
    for file in fixture.iterdir():
        if file.name != "config.json":
            (out / file.name).symlink_to(file)
    config = json.loads((fixture / "config.json").read_text()) | changes
    (out / "config.json").write_text(json.dumps(config))
    return out


def plain_mla(p: dict, x: np.ndarray, cfg) -> np.ndarray:
    """MLA head by head in float64 numpy: what latent_attention must give (before the residual).
    The rotated dims are pairs (x0, x1), (x2, x3), ..., each pair rotated by its own frequency."""
    def rms(a, scale):
        return a / np.sqrt(np.mean(a * a, -1, keepdims=True) + cfg.norm_eps) * scale
    T = x.shape[1]
    Dn, Dr, Rkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    h = rms(x, p["attn_norm"]["scale"])
    q = np.einsum("btr,rhd->bthd", rms(h @ p["q_a"]["kernel"], p["q_a_norm"]["scale"]), p["q_b"]["kernel"])
    latent = rms(h @ p["kv_a"]["kernel"][:, :Rkv], p["kv_a_norm"]["scale"])
    k_nope = np.einsum("btr,rhd->bthd", latent, p["kv_b"]["kernel"][..., :Dn])
    v = np.einsum("btr,rhd->bthd", latent, p["kv_b"]["kernel"][..., Dn:])
    angle = np.arange(T)[:, None] * cfg.rope_theta ** (-np.arange(0, Dr, 2) / Dr)  # (T, Dr / 2)
    def rotate(a):  # (..., T, Dr) in pairs -> rotated, as (the pairs' firsts, their seconds)
        first, second = a[..., 0::2], a[..., 1::2]
        return np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                               second * np.cos(angle) + first * np.sin(angle)], -1)
    q_rope = rotate(q[..., Dn:].transpose(0, 2, 1, 3))  # (B, H, T, Dr)
    k_rope = rotate((h @ p["kv_a"]["kernel"][:, Rkv:])[:, None])  # (B, 1, T, Dr), every head's
    scores = (np.einsum("bthd,bshd->bhts", q[..., :Dn], k_nope) + np.einsum("bhtd,bhsd->bhts", q_rope,
              np.broadcast_to(k_rope, q_rope.shape))) / np.sqrt(Dn + Dr)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd,hdc->btc", probs, v, p["attn_out"]["kernel"])


@contextlib.contextmanager
def read_only(folder: Path):
    """`folder` mounted read-only for the block (root only; skipped where mount is refused)."""
    made = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True, check=False)
    if made.returncode:
        pytest.skip(f"mount --bind refused here: {made.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)
