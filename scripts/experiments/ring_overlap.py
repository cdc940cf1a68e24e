"""Where the ring's collective-permutes go in a compiled TPU step: async start/done pairs or not,
and how many compute ops XLA schedules between each start and its done (the overlap).

    python scripts/experiments/ring_overlap.py        # the tiny model, dp=2,cp=4, block 256, bf16, on tpu:v5e-8

Needs the tpu extra (libtpu's compile-only devices); nothing runs on a TPU.
"""
import re

from jaxpar.core.config import load_config
from jaxpar.data.loader import load_dataset
from jaxpar.parallel.mesh import build_mesh
from jaxpar.planning.hardware import parse_target, target_devices
from jaxpar.training.step.build import build

cfg = load_config("tiny", {"mesh.cp": "4", "mesh.dp": "2", "model.block_size": "256", "model.dtype": "bfloat16"})
devices = target_devices(parse_target("tpu:v5e-8"))
mesh = build_mesh(cfg, devices)
tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
text = build(cfg, mesh, tokenizer).compile_abstract().as_text()
print("collective-permute-start:", text.count("collective-permute-start("), "done:", text.count("collective-permute-done("),
      "sync collective-permute(:", len(re.findall(r"= [^ ]+ collective-permute\(", text)))
bodies = re.findall(r"\n(%?[\w.-]*while[\w.-]*body[\w.-]*) ", text)
print("while bodies:", len(set(bodies)))
# in which computations do the starts sit?
comp, where = None, {}
for line in text.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
    if line and not line.startswith(" ") and "{" in line and m:
        comp = m.group(1)
    if "collective-permute-start(" in line:
        where[comp] = where.get(comp, 0) + 1
print(where)
lines = text.splitlines()
overlaps = []
for i, line in enumerate(lines):
    m = re.match(r"\s*(%?[\w.\-]+) = .*collective-permute-start\(", line)
    if not m:
        continue
    name = m.group(1)
    between = 0
    for later in lines[i + 1:]:
        if "collective-permute-done(" in later and name in later:
            break
        if re.search(r"= .* (fusion|convolution|dot)\(", later):
            between += 1
    overlaps.append(between)
print("compute ops between each start and its done:", overlaps)
