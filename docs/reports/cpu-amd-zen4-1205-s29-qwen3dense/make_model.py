import sys
sys.path.insert(0, "/work/main/tests")
from pathlib import Path
import tiny_models as tm
from transformers import Qwen3Config, Qwen3ForCausalLM
from tandem.convert import convert_hf
out = Path("/tmp/dense/hf"); out.mkdir(parents=True, exist_ok=True)
ids = tm.write_qwen_tokenizer(out)
config = Qwen3Config(
    vocab_size=tm.VOCAB_SIZE, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=True, initializer_range=0.02,
    bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
)
tm._save(tm._build(config, Qwen3ForCausalLM, 0), out, 0)
for q in ["q8_0", "f16"]:
    print(convert_hf(out, Path(f"/tmp/dense/qwen3-0.6b-like-{q}.gguf"), q))
