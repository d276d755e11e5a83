"""Every command README.md, the pages in docs/, each recipe's header and `make demo` show is run here, so the docs
cannot drift; every relative link and repo path they name must exist.

A page's commands are the lines of its ```bash blocks and its inline `python ...` / `accelerate launch ...` /
`headstart ...` spans
(`pip ...` and `make ...` lines are .ci/run's; ```sh and ```text blocks are shown, not run: another environment's
setup, an engine's command line). Commands run in reading order (README, then docs/ in DOC_ORDER, the recipes,
`make demo`) in one scratch directory (so `runs/...` written by one feeds the next, as for a user),
in-process, on a tiny target with a few prompts and steps: flags appended at the end override the shown ones
(the scripts take the last value). An `accelerate launch` command has its launcher flags parsed by accelerate's
own parser (the config file must exist) and its script run in this process: the GPU launches (8 GPUs,
DeepSpeed, FSDP) cannot run on a CPU, and the two-process CPU path has its own tests. Each command must
leave what its script promises (a dataset, a heads directory, a benchmark report). A benchmark-like command that
reduces to the same run as an earlier one, but for where its report goes, is not run twice (commands_to_run).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import tiny_chat_tokenizer, tiny_model
from headstart.heads.methods import method_names, method_of

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = (("accelerate", "launch"), ("python", "-m", "accelerate.commands.launch"))
PACKAGE_FOLDERS = ("train.", "heads.", "inference.")  # a script file in one of them runs as headstart.<folder>.<module>


def join_continuations(lines: list[str]) -> list[str]:
    out, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((pending + line).strip())
        pending = ""
    return [line for line in out if line]


def readme_commands(path: Path = ROOT / "README.md") -> list[str]:
    """Shell commands of a page's ```bash blocks, then its inline `python ...` / `accelerate launch ...` /
    `headstart ...`."""
    text = path.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        commands += join_continuations(block.splitlines())
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    for inline in re.findall(r"`((?:python|accelerate launch|headstart) [^`]+)`", prose):
        commands.append(re.sub(r"\s+", " ", inline))
    return [c for c in commands if not c.startswith(("pip ", "make "))]


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def recipe_commands(path: Path) -> list[str]:
    """The commands in a recipe's header comment (lines with `python ...` or `accelerate launch ...`)."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#"))
    commands = []
    for line in join_continuations(header):
        match = re.search(r"(python |accelerate launch ).*", line)
        if match:
            commands.append(re.split(r"\s{2,}\(", match.group(0))[0].strip())  # drop a trailing "   (remark)"
    return commands


def demo_commands() -> list[str]:
    """`make demo`'s commands as make would run them (setup's pip installs are .ci/run's own)."""
    dry = subprocess.run(["make", "-n", "demo", "PYTHON=python", "RUN=runs"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    commands = []
    for line in join_continuations(dry.splitlines()):
        line = line.split("||")[-1].strip()  # `test -f DONE || python ...`: run the stage
        if line.startswith(("python ", "accelerate ")) and "-m pip" not in line:
            commands.append(line)
    return commands


# The docs pages in reading order: a page's commands may use what an earlier page's commands wrote (`runs/...`).
# A page not named here comes after these, by name.
DOC_ORDER = ("data", "training", "heads_training", "generation", "benchmark", "serving", "half_precision", "measured",
             "design", "safety")


def doc_pages() -> list[Path]:
    """docs/*.md in DOC_ORDER, then any other page by name."""
    order = {name: i for i, name in enumerate(DOC_ORDER)}
    return sorted((ROOT / "docs").glob("*.md"), key=lambda p: (order.get(p.stem, len(order)), p.name))


def all_commands() -> list[tuple[str, str]]:
    """(where shown, command), each distinct command once, in the order a reader meets them."""
    out = [("README", c) for c in readme_commands()]
    for path in doc_pages():
        out += [(str(path.relative_to(ROOT)), c) for c in readme_commands(path)]
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        out += [(str(path.relative_to(ROOT)), c) for c in recipe_commands(path)]
    out += [("make demo", c) for c in demo_commands()]
    seen, unique = set(), []
    for where, command in out:
        key = " ".join(shlex.split(command))
        if key not in seen:
            seen.add(key)
            unique.append((where, command))
    return unique


# ---------------------------------------------------------------------------------------------------------
# reductions: what is appended to a command's script arguments


def recipe_field(args: list[str], key: str):
    if "--config" not in args:
        return None
    return (yaml.safe_load((ROOT / args[args.index("--config") + 1]).read_text()) or {}).get(key)


# each registered method's trainer module -> its config dataclass (heads/methods.py): the training commands
TRAINER_CONFIGS = {method_of(name).trainer: method_of(name).train_config for name in method_names()
                   if method_of(name).trainer is not None}
PROMPTS = "10"  # prompts self-distilled, by a script or by a trainer that finds no data (the same settings)


def reduce_args(module: str, args: list[str], target: str) -> list[str]:
    if module == "headstart.train.selfdistill":  # the recipe's generation settings stay: a trainer's self-distillation uses them
        return args + ["--target", target, "--num_prompts", PROMPTS]
    if module in TRAINER_CONFIGS:
        extra = ["--target", target, "--num_prompts", PROMPTS, "--max_steps", "2", "--eval_rows", "2",
                 "--per_device_batch_size", "2", "--gradient_accumulation_steps", "1", "--checkpoint_every", "1", "--max_length", "256",
                 "--report_to", "none"]
        if (recipe_field(args, "draft_vocab_size") or 0) > 64:
            extra += ["--draft_vocab_size", "64"]  # the tiny target's vocabulary is 320 tokens
        return args + extra
    if module == "headstart.heads.export" and last_value(args, "--format") == "llamacpp":  # the docs target's own GGUF
        return [*args, "--target_gguf", str(docs_target_gguf(target))] if target else args
    if module == "headstart.inference.generate":
        return args + ["--max_new_tokens", "8"]
    if module == "headstart.inference.bench":
        return args + ["--num_prompts", "2", "--max_new_tokens", "8"] + (["--per_category", "1"] if "--per_category" in args else [])
    if module == "headstart.inference.forward":
        return args + ["--target", target, "--repeats", "2"]
    if module == "headstart.inference.acceptance":
        return args + ["--per_category", "1", "--max_new_tokens", "8"]
    if module == "headstart.inference.replay":
        return args + ["--per_category", "1", "--max_new_tokens", "8"]
    if module == "headstart.train.bench_selfdistill":
        return args + ["--target", target, "--num_prompts", "4", "--max_new_tokens", "8", "--batch_sizes", "2",
                       "--generate_batch_sizes", "2", "--repeats", "1"]
    if module == "scripts.demo":  # its stages in subprocesses, one process each, reduced as above
        train = reduce_args("headstart.train.medusa", ["--config", "recipes/smollm2-135m/medusa.yaml"], target)[2:]
        return args + ["--target", target, "--num_prompts", PROMPTS, "--processes", "1", "--bench_per_category", "1",
                       "--max_new_tokens", "8", "--train_args=" + shlex.join(train[train.index("--max_steps"):])]
    return args


def docs_target_gguf(target: str) -> Path:
    """A GGUF of the docs target (its graph, sizes and a tokenizer; what a llama.cpp export reads), written once."""
    from test_export_gguf import target_gguf
    from transformers import AutoConfig

    path = Path(target) / "target.gguf"
    if not path.is_file():
        config = AutoConfig.from_pretrained(target)
        target_gguf(path, layers=config.num_hidden_layers, vocab=config.vocab_size)
    return path


def script_and_args(command: str) -> tuple[str, list[str]]:
    """-> (module to run, its argv). Launcher flags are checked with accelerate's parser. `headstart STAGE ...` runs
    the stage's module (headstart/cli.py: `train` the recipe's trainer); `headstart --help`, headstart.cli itself."""
    words = shlex.split(command, comments=True)
    if words[0] == "headstart":
        from headstart.cli import STAGES, trainer_module

        if len(words) < 2 or words[1] not in STAGES:
            return "headstart.cli", words[1:]
        module = trainer_module(words[2:]) if words[1] == "train" else STAGES[words[1]][0]
        assert module is not None, f"{command}: names no recipe with a method: and no --method"
        return module, words[2:]
    for launcher in LAUNCHERS:
        if tuple(words[: len(launcher)]) == launcher:
            from accelerate.commands.launch import launch_command_parser

            launch = launch_command_parser().parse_args(words[len(launcher):])
            if launch.config_file:
                assert (ROOT / launch.config_file).is_file(), f"{command}: no {launch.config_file}"
            words = ["python", launch.training_script, *launch.training_script_args]
            break
    assert words[0] == "python", f"not a python command: {command}"
    if words[1] == "-c":
        return "-c", words[2:]
    if words[1] == "-m":
        return words[2], words[3:]
    assert words[1].endswith(".py") and (ROOT / words[1]).is_file(), f"{command}: no script {words[1]}"
    module = words[1][:-3].replace("/", ".")
    return (f"headstart.{module}" if module.startswith(PACKAGE_FOLDERS) else module), words[2:]


def last_value(args: list[str], flag: str, default=None):
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values[-1] if values else default


CONFIG_CLASSES = {"headstart.train.selfdistill": "SelfDistillConfig", **TRAINER_CONFIGS}


def output_dir(module: str, args: list[str]) -> Path | None:
    """Where a self-distillation or training command writes, as the script's own parser reads its arguments."""
    if module not in CONFIG_CLASSES:
        return None
    from headstart.train.config import parse_config

    return Path(parse_config(getattr(importlib.import_module(module), CONFIG_CLASSES[module]), args).output_dir)


def written_at(module: str, args: list[str]) -> int:
    """mtime of the file a command (re)writes last: meta.json or heads/model.safetensors; 0 if absent."""
    out = output_dir(module, args)
    file = None if out is None else out / ("meta.json" if module == "headstart.train.selfdistill" else "heads/model.safetensors")
    return file.stat().st_mtime_ns if file is not None and file.is_file() else 0


def check_outputs(module: str, args: list[str], printed: str) -> None:
    """What the script promises to leave behind."""
    if "--help" in args:  # a stage's (or the command's) help: its usage, nothing written
        assert "usage: " in printed
        return
    out = output_dir(module, args)
    if module == "headstart.train.selfdistill":
        assert (out / "dataset").is_dir() and (out / "meta.json").is_file()
    elif module in CONFIG_CLASSES and last_value(args, "--build_cache_only", "false") == "true":
        assert (Path(last_value(args, "--feature_cache_dir")) / "cache.json").is_file()  # the cache (or vLLM's request)
    elif module in CONFIG_CLASSES:
        assert (out / "heads" / "config.json").is_file() and (out / "heads" / "model.safetensors").is_file()
        if json.loads((out / "heads" / "config.json").read_text())["method"] == "medusa2":
            assert (out / "heads" / "adapter" / "adapter_config.json").is_file()
    elif module == "headstart.inference.bench":
        out = Path(last_value(args, "--output"))
        assert (out / "results.json").is_file() and (out / "results.md").is_file()
    elif module == "headstart.inference.generate":
        assert "tau" in printed
    elif module == "headstart.train.bench_selfdistill":
        methods = args[args.index("--methods") + 1:] if "--methods" in args else ["generate", "packed"]
        methods = methods[:next((i for i, a in enumerate(methods) if a.startswith("--")), len(methods))]
        assert "batch  tok/s (median" in printed
        assert all(f"\n{method} " in printed for method in methods)  # a summary row for each method asked for
    elif module == "headstart.inference.acceptance" and "--chain" in args:
        assert "greedy chain of" in printed and (Path(last_value(args, "--heads")) / "chain_acceptance.json").is_file()
        heads = args[args.index("--heads") + 1:]
        for head in heads[:next((i for i, a in enumerate(heads) if a.startswith("--")), len(heads))]:
            if json.loads((Path(head) / "config.json").read_text()).get("method") == "dspark":  # its confidence head too
                assert "confidence" in json.loads((Path(head) / "chain_acceptance.json").read_text())
    elif module == "headstart.inference.acceptance":
        assert "| heads | lookup |" in printed and Path(last_value(args, "--output")).is_file()
    elif module == "headstart.inference.replay":
        assert "| adaptive +lookup |" in printed and Path(last_value(args, "--output")).is_file()
    elif module == "scripts.demo":
        from headstart.train.config import parse_config

        out = Path(parse_config(importlib.import_module(module).DemoConfig, args).output_dir)
        assert (out / "bench" / "results.json").is_file() and (out / "stages.json").is_file()
        assert "| Medusa-1 +lookup |" in printed and "Next:" in printed and (out / "summary.md").read_text() in printed
        recipes = sorted(p.stem for p in (ROOT / "recipes" / "smollm2-135m").glob("*.yaml") if p.stem != "selfdistill")
        assert f"one per method ({', '.join(recipes)})" in printed and "dspark" in recipes  # every recipe, DSpark's too
        assert "Speedup by task family:" in printed and "| writing |" in printed
        assert "In an engine" in printed and "- vLLM: " in printed and "--format vllm" in printed
    elif module == "headstart.heads.export" and last_value(args, "--format") == "llamacpp":
        out = Path(args[1])
        assert (out / "draft.gguf").is_file() and (out / "README.md").is_file() and "llama-server -m" in printed
    elif module == "headstart.heads.export":
        out = Path(args[1])
        assert (out / "config.json").is_file() and (out / "model.safetensors").is_file() and (out / "README.md").is_file()


@pytest.fixture(scope="module")
def docs_target(tmp_path_factory) -> str:
    """A saved tiny Llama target with a chat template; 4 layers, so EAGLE-3's default taps suit every engine export."""
    path = tmp_path_factory.mktemp("docs-target")
    tokenizer = tiny_chat_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=4, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch directory that sees the repo's recipes and test data, as a user's checkout would. tests/data is a
    copy: a documented `--tree auto` writes tree.json into the heads directory it calibrates."""
    path = tmp_path_factory.mktemp("docs")
    (path / "recipes").symlink_to(ROOT / "recipes")
    (path / "tests").mkdir()
    for entry in (ROOT / "tests").iterdir():
        if entry.name == "data":
            shutil.copytree(entry, path / "tests" / "data")
        else:
            (path / "tests" / entry.name).symlink_to(entry)
    return path


@pytest.fixture(scope="module")
def docs_server(docs_target):
    """A fake OpenAI-compatible server on the tiny target (tests/fake_openai.py), for `--backend openai` commands."""
    from fake_openai import FakeServer

    server = FakeServer(docs_target).start()
    yield server
    server.stop()


REPORT_ONLY = ("headstart.inference.bench", "headstart.inference.replay", "headstart.inference.acceptance")  # scripts whose reports no command reads


def flag_values(args: list[str]) -> dict[str, tuple[str, ...]]:
    """A script's `--flag value...` arguments, the last occurrence of a flag winning, as its parser takes them."""
    values: dict[str, tuple[str, ...]] = {}
    flag = None
    for arg in args:
        if arg.startswith("--"):
            flag, _, value = arg.partition("=")
            values[flag] = (value,) if value else ()
        elif flag is not None:
            values[flag] += (arg,)
    return values


def commands_to_run(commands: list[tuple[str, str]]) -> list[tuple[int, str, str]]:
    """(index, where, command) of the commands to run: all but a report-only command whose reduced run is an
    earlier one's but for where its report goes (e.g. two benchmark sizes of the same heads: reduced to one prompt
    per family and 8 tokens, they run alike)."""
    seen, out = set(), []
    for i, (where, command) in enumerate(commands):
        module, args = script_and_args(command)
        if module in REPORT_ONLY:
            values = flag_values(reduce_args(module, args, target=""))
            key = (module, tuple(sorted((flag, v) for flag, v in values.items() if flag != "--output")))
            if key in seen:
                continue
            seen.add(key)
        out.append((i, where, command))
    return out


COMMANDS = all_commands()
TO_RUN = commands_to_run(COMMANDS)


def skip_reason(module: str, args: list[str]) -> str | None:
    """Why a documented command cannot run here (an engine it needs is another lane's), or None."""
    if module == "headstart.inference.vllm_check" or module.startswith("vllm."):
        return ("vLLM's own commands need vLLM and heads trained on the embedded target: the vLLM lane (tests/test_vllm.py, with "
                "HEADSTART_VLLM_PYTHON and HEADSTART_VLLM_HEADS) makes the same comparison")
    if module == "headstart.inference.llamacpp_check":
        return ("llama.cpp's own commands need llama-server and heads trained on the embedded target: the llama.cpp "
                "lane (tests/test_llamacpp.py, with HEADSTART_LLAMACPP_SERVER and HEADSTART_LLAMACPP_HEADS) runs them")
    if module == "headstart.train.selfdistill" and last_value(args, "--backend") == "vllm":
        return "--backend vllm needs vLLM: the vLLM lane of tests/test_selfdistill_engines.py (HEADSTART_VLLM_PYTHON) runs it"
    return None


def run_documented(where: str, command: str, docs_target: str, request) -> None:
    """Run one documented command, reduced, in the current (scratch) directory, and check what it leaves."""
    module, args = script_and_args(command)
    backend = last_value(args, "--backend") if module == "headstart.train.selfdistill" else None
    args = reduce_args(module, args, docs_target)
    if backend == "openai":  # the servers shown are vLLM's: a fake one on the tiny target answers instead
        args += ["--server_url", request.getfixturevalue("docs_server").url]
    before = written_at(module, args)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        if module == "-c":  # python -c CODE
            result = exec(compile(args[0], command, "exec"), {})
        else:
            try:
                result = importlib.import_module(module).main(args)
            except SystemExit as done:  # `--help` / `--version`: the parser prints and exits
                result = done.code
    assert result in (None, 0) or isinstance(result, dict), f"{where}: `{command}` returned {result!r}\n{printed.getvalue()}"
    check_outputs(module, args, printed.getvalue())
    if module in TRAINER_CONFIGS and last_value(args, "--build_cache_only") != "true":
        # a rerun into the same directory wrote its heads again
        assert written_at(module, args) > before, f"{where}: `{command}` wrote no heads"


STARTED: set[int] = set()  # COMMANDS indices (TO_RUN's first field) already started in this module's scratch directory


def run_earlier(index: int, docs_target: str, request) -> None:
    """Run the documented commands before TO_RUN's `index` that have not run yet. A command may read what an earlier
    one wrote (`runs/...`): a test selected alone (`-k`) finds it there, as a reader who followed the docs would. In a
    whole-file run they have run already."""
    for earlier, where, command in TO_RUN:
        if earlier >= index:
            break
        if earlier not in STARTED and skip_reason(*script_and_args(command)) is None:
            STARTED.add(earlier)
            run_documented(where, command, docs_target, request)


@pytest.mark.parametrize("index,where,command", TO_RUN, ids=[f"{w}:{i}" for i, w, _ in TO_RUN])
def test_documented_command_runs(index, where, command, workdir, docs_target, monkeypatch, one_thread, request):
    monkeypatch.chdir(workdir)
    run_earlier(index, docs_target, request)
    STARTED.add(index)
    reason = skip_reason(*script_and_args(command))
    if reason is not None:
        pytest.skip(reason)
    run_documented(where, command, docs_target, request)


def test_readme_python_runs(workdir, docs_target, monkeypatch, one_thread, request):
    blocks = readme_python_blocks()
    assert blocks, "README shows no Python example"
    monkeypatch.chdir(workdir)
    first_after_readme = next((i for i, where, _ in TO_RUN if where != "README"), len(COMMANDS))
    run_earlier(first_after_readme, docs_target, request)  # the README's commands: runs/medusa-smollm2/heads
    for block in blocks:
        namespace: dict = {}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, "README.md", "exec"), namespace)
        assert namespace["out"].stats.new_tokens > 0


def test_readme_install_lines_are_what_ci_and_make_setup_run():
    readme = re.findall(r"^pip install ([^#\n]*?)\s*(?:#.*)?$", (ROOT / "README.md").read_text(), flags=re.M)
    makefile, ci = (ROOT / "Makefile").read_text(), (ROOT / ".ci" / "run").read_text()
    assert len(readme) == 3
    for args in readme:
        assert f"pip install {args}" in makefile, args
        assert f"pip install -q {args}" in ci, args


def test_every_recipe_header_shows_a_command():
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        assert recipe_commands(path), f"{path} shows no launch command in its header"


# ---------------------------------------------------------------------------------------------------------
# links and paths: nothing the docs name may be missing from the repo

PAGES = [ROOT / "README.md", *doc_pages()]
REPO_PATH = re.compile(r"(?:heads|train|inference|tests|recipes|scripts|docs)/[\w./-]*")  # a repo path in backticks


def prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", prose(page.read_text()), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_docs_links_and_paths_exist(page):
    text = prose(page.read_text())
    missing = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            missing.append(f"link {link}: no {path}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            missing.append(f"link {link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    for span in re.findall(r"`([^`\n]+)`", text):
        if REPO_PATH.fullmatch(span) and not (ROOT / span).exists():
            missing.append(f"`{span}`: no such file in the repo")
    assert not missing, f"{page.relative_to(ROOT)}: " + "; ".join(missing)
