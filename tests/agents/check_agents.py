"""Agent CLIs, installed unchanged from their registries, each running one headless turn
("list the files here") against `corral serve` over its own API.

Usage: python check_agents.py CORRAL_BINARY CLIENTS_DIR [NAME ...]

CLIENTS_DIR holds what run.sh installed: `node_modules/` (Claude Code, Codex, Qwen Code,
opencode, Continue's `cn`) and `aider-venv/`. NAMEs pick clients (default: all).

The server runs the repo's demo model with Qwen3.5's official chat template (tool calls in
XML, one system message first) and `--default-chat-template-kwargs '{"enable_thinking":
false}'`. The demo model has random weights, which write until `max_tokens` and never close a
turn; Claude Code and Qwen Code take a reply cut at `max_tokens` as an error or ask the model
to go on. So the server serves a copy of the demo model whose generation_config.json names
one token id in forty (and the usual two) as end-of-turn ids: replies end after about forty
tokens, as a real model's do, and the weights are the demo model's. (One in ten left Qwen
Code three empty replies in a row now and then, which it gives up on.) The copy's context is 131,072
tokens (agents' system prompts and tools run to ~36k tokens of the demo model's small
vocabulary); with random weights, positions past the trained length change nothing.

A client passes when it exits 0 and every request it sent was answered with a 2xx: the
server's own count per endpoint and status (`corral_requests_total` in /metrics) is read
before and after. Prints one line per client (version, requests by endpoint, seconds) and a
final `N passed, M failed` line; exits non-zero on a failure.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models" / "tiny-qwen3-moe"
TEMPLATE = Path(os.environ.get("CORRAL_TEMPLATES_DIR", REPO / "target" / "qwen-templates")) / "Qwen3.5-4B.jinja"
MODEL = "tiny"
API_KEY = "sk-corral-agents"
PROMPT = "list the files here"
TIMEOUT = 600


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_model(work):
    """The demo model's weights and tokenizer with a long context and ending turns; or, with
    CORRAL_AGENT_MODEL set, that model directory as it is (a trained model ends its own turns)."""
    if os.environ.get("CORRAL_AGENT_MODEL"):
        return Path(os.environ["CORRAL_AGENT_MODEL"]).resolve()
    model = work / "model"
    if model.exists():
        shutil.rmtree(model)
    model.mkdir(parents=True)
    for name in ["model.safetensors", "tokenizer.json", "tokenizer_config.json"]:
        (model / name).symlink_to(DEMO / name)
    config = json.loads((DEMO / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (model / "config.json").write_text(json.dumps(config, indent=2))
    generation = json.loads((DEMO / "generation_config.json").read_text())
    usual = generation["eos_token_id"]
    generation["eos_token_id"] = usual + [i for i in range(0, 1536, 40) if i not in usual]
    (model / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return model


def start_server(binary, model, port, log):
    process = subprocess.Popen(
        [binary, "serve", "--model", str(model), "--port", str(port), "--threads", "2",
         "--api-key", API_KEY, "--served-model-name", MODEL, "--kv-memory", "1G",
         "--max-batch", "2", "--chat-template", str(TEMPLATE),
         "--default-chat-template-kwargs", '{"enable_thinking": false}'],
        stdout=subprocess.DEVNULL, stderr=log,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("server did not become healthy")


def request_counts(port):
    """`{(endpoint, status): n}` from the server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    counts = {}
    for m in re.finditer(r'corral_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\d+)', text):
        counts[(m.group(1), int(m.group(2)))] = int(m.group(3))
    return counts


def version(clients, package):
    return json.loads((clients / "node_modules" / package / "package.json").read_text())["version"]


def npm_bin(clients, name):
    return str(clients / "node_modules" / ".bin" / name)


def platform_binary(clients, prefix, name):
    """A client's native binary from its platform package (`PREFIX-linux-x64/NAME`): the
    package's own launcher is put in place by an install script, which run.sh leaves unrun."""
    found = sorted(p for p in (clients / "node_modules").glob(f"{prefix}-linux-*/**/{name}")
                   if p.is_file() and "musl" not in str(p) and "baseline" not in str(p))
    if not found:
        sys.exit(f"no {prefix}-linux-* package with a `{name}` binary in {clients}")
    return str(found[0])


def claude_code(clients, base, home):
    env = {
        "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": API_KEY, "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512", "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    claude = platform_binary(clients, "@anthropic-ai/claude-code", "claude")
    cmd = [claude, "-p", PROMPT, "--output-format", "json"]
    return cmd, env, version(clients, "@anthropic-ai/claude-code"), "/v1/messages"


def codex(clients, base, home):
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(f"""model = "{MODEL}"
model_provider = "corral"

[model_providers.corral]
name = "Corral"
base_url = "{base}/v1"
env_key = "CORRAL_API_KEY"
wire_api = "responses"
""")
    cmd = [npm_bin(clients, "codex"), "exec", "--skip-git-repo-check", PROMPT]
    return cmd, {"CORRAL_API_KEY": API_KEY}, version(clients, "@openai/codex"), "/v1/responses"


def qwen_code_openai(clients, base, home):
    env = {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": MODEL}
    cmd = [npm_bin(clients, "qwen"), PROMPT, "--auth-type", "openai", "-m", MODEL]
    return cmd, env, version(clients, "@qwen-code/qwen-code"), "/v1/chat/completions"


def qwen_code_anthropic(clients, base, home):
    env = {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": API_KEY, "ANTHROPIC_MODEL": MODEL}
    cmd = [npm_bin(clients, "qwen"), PROMPT, "--auth-type", "anthropic", "-m", MODEL]
    return cmd, env, version(clients, "@qwen-code/qwen-code"), "/v1/messages"


def opencode(clients, base, home):
    config = home / ".config" / "opencode"
    config.mkdir(parents=True, exist_ok=True)
    (config / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"corral": {
            "npm": "@ai-sdk/openai-compatible", "name": "Corral",
            "options": {"baseURL": f"{base}/v1", "apiKey": API_KEY},
            "models": {MODEL: {"name": MODEL}}}},
        "model": f"corral/{MODEL}", "autoupdate": False, "share": "disabled",
    }, indent=2))
    binary = platform_binary(clients, "opencode", "opencode")
    cmd = [binary, "run", PROMPT, "-m", f"corral/{MODEL}"]
    return cmd, {}, version(clients, "opencode-ai"), "/v1/chat/completions"


def continue_cli(clients, base, home):
    config = home / ".continue" / "config.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(f"""name: corral
version: 1.0.0
schema: v1
models:
  - name: {MODEL}
    provider: openai
    model: {MODEL}
    apiBase: {base}/v1
    apiKey: {API_KEY}
    roles: [chat, edit, apply]
""")
    cmd = [npm_bin(clients, "cn"), "-p", PROMPT, "--config", str(config)]
    return cmd, {}, version(clients, "@continuedev/cli"), "/v1/chat/completions"


def aider(clients, base, home):
    venv = clients / "aider-venv"
    env = {"OPENAI_API_BASE": f"{base}/v1", "OPENAI_API_KEY": API_KEY,
           "AIDER_CHECK_UPDATE": "false", "AIDER_ANALYTICS": "false"}
    cmd = [str(venv / "bin" / "aider"), "--model", f"openai/{MODEL}", "--message", PROMPT,
           "--yes-always", "--no-git", "--no-show-model-warnings", "--no-pretty",
           "--no-stream", "--map-tokens", "0", "--no-check-update", "--no-analytics",
           # Its histories go to the git root it finds (this repository's) unless placed.
           "--input-history-file", str(home / "aider.input.history"),
           "--chat-history-file", str(home / "aider.chat.history.md")]
    out = subprocess.run([str(venv / "bin" / "pip"), "show", "aider-chat"],
                         capture_output=True, text=True).stdout
    found = re.search(r"^Version: (.+)$", out, re.M)
    return cmd, env, found.group(1) if found else "?", "/v1/chat/completions"


CLIENTS = {
    "claude-code": claude_code,
    "codex": codex,
    "qwen-code-openai": qwen_code_openai,
    "qwen-code-anthropic": qwen_code_anthropic,
    "opencode": opencode,
    "continue": continue_cli,
    "aider": aider,
}


def main():
    binary, clients = sys.argv[1], Path(sys.argv[2]).resolve()
    names = sys.argv[3:] or list(CLIENTS)
    unknown = [n for n in names if n not in CLIENTS]
    if unknown:
        sys.exit(f"unknown clients {unknown}; known: {list(CLIENTS)}")
    if not TEMPLATE.exists():
        sys.exit(f"{TEMPLATE} is missing (scripts/fetch_templates.sh fetches it)")
    work = clients / "run"
    work.mkdir(parents=True, exist_ok=True)
    model = agent_model(work)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = work / "server.log"
    passed = failed = 0
    with open(log_path, "w") as log:
        server = start_server(binary, model, port, log)
        try:
            for name in names:
                home = work / f"home-{name}"
                if home.exists():
                    shutil.rmtree(home)
                home.mkdir(parents=True)
                project = work / f"project-{name}"
                if project.exists():
                    shutil.rmtree(project)
                project.mkdir()
                (project / "README.md").write_text("# A small project\n")
                (project / "main.py").write_text("print('hello')\n")
                cmd, extra, client_version, endpoint = CLIENTS[name](clients, base, home)
                env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home),
                       "TERM": "dumb", "NO_COLOR": "1", "CI": "1", **extra}
                before = request_counts(port)
                started = time.time()
                try:
                    run = subprocess.run(cmd, cwd=project, env=env, capture_output=True,
                                         text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
                    code, out, err = run.returncode, run.stdout, run.stderr
                except subprocess.TimeoutExpired as e:
                    code, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
                seconds = time.time() - started
                after = request_counts(port)
                sent = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                sent = {k: n for k, n in sent.items() if n > 0 and k[0] != "/metrics"}
                errors = {k: n for k, n in sent.items() if not 200 <= k[1] < 300}
                answered = sum(n for (e, s), n in sent.items() if e == endpoint and 200 <= s < 300)
                by_endpoint = ", ".join(f"{e} {s}: {n}" for (e, s), n in sorted(sent.items()))
                ok = code == 0 and not errors and answered > 0
                status = "ok" if ok else "FAILED"
                print(f"{status}: {name} {client_version}: exit {code}, {by_endpoint or 'no requests'}, "
                      f"{seconds:.1f} s", flush=True)
                if os.environ.get("CORRAL_AGENT_MODEL"):
                    print(f"  stdout: {out[-3000:]}")
                if ok:
                    passed += 1
                else:
                    failed += 1
                    print(f"  command: {' '.join(cmd)}\n  stdout: {out[-2000:]}\n  stderr: {err[-2000:]}")
        finally:
            server.terminate()
            server.wait(timeout=30)
    if failed:
        print(f"server log: {log_path}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
