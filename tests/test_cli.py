"""``zerocc plan``: a mistake in the arguments is one line and exit code 2; the table's unit fits the numbers."""
from __future__ import annotations

import pytest

from zerocc.cli import main, table

TINY = ["plan", "--model", "tests.models:TinyGPT", "--inputs", "long:2x16", "long:2x16", "--world-size", "1",
        "--stage", "0", "--plot", ""]


@pytest.mark.parametrize("arguments,message", [
    (["--model", "tests.no_such_module:GPT"], r"--model 'tests.no_such_module:GPT': cannot import "
                                              r"'tests.no_such_module' \(No module named"),
    (["--model", "tests.models:NoSuchFactory"], r"--model 'tests.models:NoSuchFactory': 'tests.models' has no "
                                                r"attribute 'NoSuchFactory'"),
    (["--model", "missing/file.py:GPT"], r"--model 'missing/file.py:GPT': no file 'missing/file.py'"),
    (["--model-kwargs", "{layers: 2}"], r"--model-kwargs '\{layers: 2\}': not JSON \(Expecting property name"),
    (["--model-kwargs", "[2]"], r"--model-kwargs '\[2\]': expected a JSON object"),
    (["--model-kwargs", '{"no_such_keyword": 2}'], r"--model 'tests.models:TinyGPT' with --model-kwargs .*"
                                                   r"unexpected keyword argument 'no_such_keyword'"),
    (["--inputs", "long:2xa"], r"--inputs 'long:2xa': the shape must be sizes joined by x, e.g. long:8x1024"),
    (["--inputs", "idx=long:2x16", "long:2x16"], r"--inputs 'long:2x16': a positional input after a keyword one"),
    (["--inputs", "2x=long:2x16"], r"--inputs '2x=long:2x16': expected name=dtype:shape with a new keyword name"),
    (["--inputs", "bfloat17:2x16"], r"--inputs 'bfloat17:2x16': unknown dtype 'bfloat17'; .* or bf16, fp16, fp32"),
    (["--world-size", "eight"], r"--world-size 'eight': expected positive ints, comma-separated"),
    (["--world-size", "0"], r"--world-size '0': expected positive ints"),
    (["--stage", "4"], r"--stage '4': expected some of 0, 1, 2, 3, comma-separated"),
    (["--param-dtype", "bf17"], r"--param-dtype: unknown dtype 'bf17'"),
    (["--plot", "no/such/folder/plan.png"], r"--plot 'no/such/folder/plan.png': the folder .* does not exist"),
    (["--json", "no/such/folder/plan.json"], r"--json 'no/such/folder/plan.json': the folder .* does not exist"),
    # these were tracebacks, some after planning every configuration (the plot is written last)
    (["--plot", "plan.txt"], r"--plot 'plan.txt': matplotlib writes no 'txt' files; end the name with one of .*\.png"),
    (["--bucket-mb", "0"], r"--bucket-mb 0: expected a positive size in MiB"),
    (["--lr", "-1"], r"--lr -1: expected a non-negative learning rate"),
    (["--param-dtype", "long"], r"--param-dtype 'long': expected a floating dtype"),
    (["--device", "gpu0"], r"--device 'gpu0': not a torch device; e.g. meta"),
    (["--model", ":TinyGPT"], r"--model ':TinyGPT': expected module:factory"),
    (["--dump-dir", "a_file"], r"--dump-dir 'a_file' is a file, not a folder"),
])
def test_a_bad_argument_is_one_line_and_exit_code_2(arguments, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # relative paths resolve here; the tests package stays importable
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent.parent))
    (tmp_path / "a_file").write_text("")
    assert main(TINY + arguments) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("[zerocc plan")]
    assert len(lines) == 1, err
    assert lines[0].startswith("zerocc plan: error: ")
    assert __import__("re").search(message, lines[0]), lines[0]


def test_dtype_aliases_are_accepted(capsys):
    assert main([*TINY, "--param-dtype", "bf16"]) == 0
    out = capsys.readouterr().out   # the plans compute in float32: bfloat16 is how the table counts bytes
    assert "mixed-precision accounting: bfloat16" in out and "bfloat16 accounting:" in out, out


def test_the_table_unit_fits_a_small_model(capsys):
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert "model states per rank (kB = 1e3 bytes)" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("0 "))
    assert all(cell != "0.000" for cell in row.split()[2:6]), row   # comm/step is 0 at one rank
    assert "step peak" in out.splitlines()[1]


def test_dumps_of_several_plans_are_kept_apart(tmp_path):
    """--dump-dir with several stages or world sizes wrote every plan's files under the same names: only the
    last plan's were left."""
    assert main([*TINY[:-6], "--world-size", "1,2", "--stage", "0,3", "--plot", "", "--dump-dir",
                 str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage0_world1", "stage0_world2", "stage3_world1",
                                                         "stage3_world2"]
    shard = (tmp_path / "stage3_world2" / "001_shard.py").read_text()
    assert shard.startswith("# after pass 01 'shard'") and "reduce_gradient" in shard


def test_the_table_unit_fits_a_large_model():
    text = table([(3, 1024, 2 * 10 ** 9, 10 ** 9, 12 * 10 ** 9, 15 * 10 ** 9, 4 * 10 ** 9, 17 * 10 ** 9)], 10 ** 9,
                 "bfloat16")
    assert "(GB = 1e9 bytes)" in text and "15.000" in text and "17.000" in text


HUGGING_FACE_FACTORY = """
import transformers


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128))
"""


def test_keyword_inputs_plan_a_hugging_face_model_that_returns_its_loss(capsys, tmp_path):
    """A causal LM takes its batch by keyword (labels is not its second parameter): with positional inputs
    only, the CLI could not plan one (the labels went in as the attention mask, and no loss came back)."""
    pytest.importorskip("transformers")
    (tmp_path / "factory.py").write_text(HUGGING_FACE_FACTORY)
    assert main(["plan", "--model", f"{tmp_path / 'factory.py'}:llama", "--inputs", "input_ids=long:2x16",
                 "labels=long:2x16", "--world-size", "1,2", "--plot", ""]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("3 ")]
    assert [row[1] for row in rows] == ["1", "2"], out
    assert float(rows[1][5]) == pytest.approx(float(rows[0][5]) / 2, rel=0.01)   # stage 3 halves model states


def test_a_plot_named_without_an_extension_is_reported_as_the_file_written(tmp_path, capsys):
    """matplotlib writes `--plot plan` as plan.png; the CLI said "plot: plan", a file that does not exist."""
    pytest.importorskip("matplotlib")
    assert main([*TINY[:-1], str(tmp_path / "plan")]) == 0
    assert f"plot: {tmp_path / 'plan.png'}" in capsys.readouterr().out
    assert (tmp_path / "plan.png").is_file()
