"""`terminal`: tasks over a generated virtual file system with `ls`, `cat`, `grep` and `find`.

Pure Python: the file system is a dict of paths to contents, built per task from its seed; no real
shell is involved. Difficulty:
  1: the value of a key in a known config file                 (cat)
  2: which log file contains a given error code                 (grep)
  3: the token inside a file whose name is only partly known    (find, then cat)
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, Mapping

from jaxrl_agent.envs import api, tool_protocol as tp

_PATH = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
LS = tp.ToolSpec("ls", "Lists a directory.", _PATH)
CAT = tp.ToolSpec("cat", "Prints a file.", _PATH)
GREP = tp.ToolSpec("grep", "Lists files under path whose text contains pattern (fixed string), with the line.",
                   {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                    "required": ["pattern", "path"]})
FIND = tp.ToolSpec("find", "Lists files under path whose name contains name.",
                   {"type": "object", "properties": {"name": {"type": "string"}, "path": {"type": "string"}},
                    "required": ["name", "path"]})
TOOLS = (LS, CAT, GREP, FIND)
WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta")
MAX_OUTPUT_CHARS = 2000


def build_fs(seed: int, difficulty: int) -> tuple[dict[str, str], dict[str, str]]:
    """(files {path: content}, facts used by the task). Deterministic in (seed, difficulty)."""
    rng = api.task_rng("terminal/fs", seed, difficulty)
    files: dict[str, str] = {}
    apps = rng.sample(WORDS, 3)
    for app in apps:
        files[f"/etc/{app}/config.ini"] = "\n".join(
            [f"name={app}", f"port={rng.randint(1024, 65535)}", f"workers={rng.randint(1, 64)}",
             f"mode={rng.choice(['fast', 'safe', 'debug'])}"])
    codes = rng.sample(range(1000, 9999), 6)
    for i, code in enumerate(codes):
        lines = [f"INFO start {rng.randint(0, 10**6)}" for _ in range(rng.randint(2, 5))]
        lines.insert(rng.randint(0, len(lines)), f"ERROR E{code} failure in {rng.choice(WORDS)}")
        files[f"/var/log/{rng.choice(apps)}/run{i}.log"] = "\n".join(lines)
    token = "".join(rng.choice("abcdef0123456789") for _ in range(12))
    secret_dir = "/srv/" + "/".join(rng.sample(WORDS, rng.randint(1, 3)))
    secret_name = f"secret_{rng.choice(WORDS)}_{rng.randint(10, 99)}.txt"
    files[posixpath.join(secret_dir, secret_name)] = f"owner={rng.choice(WORDS)}\ntoken={token}\n"
    for i in range(4):
        files[f"/srv/{rng.choice(WORDS)}/data{i}.csv"] = "\n".join(
            ",".join(str(rng.randint(0, 99)) for _ in range(3)) for _ in range(3))
    files["/home/user/notes.txt"] = "remember to rotate the logs"
    target_app = rng.choice(apps)
    key = rng.choice(["port", "workers", "mode"])
    target_code = rng.choice(codes)
    facts = {"app": target_app, "key": key, "code": f"E{target_code}", "token": token, "secret_name": secret_name}
    return files, facts


def _prompt(difficulty: int, facts: Mapping[str, str]) -> str:
    if difficulty == 1:
        return f"What is the value of {facts['key']} in /etc/{facts['app']}/config.ini?"
    if difficulty == 2:
        return f"Which file under /var/log contains error {facts['code']}? Answer with its path."
    prefix = facts["secret_name"].rsplit("_", 1)[0]
    return f"A file whose name starts with {prefix} is somewhere under /srv. What token does it contain?"


def _answer(files: Mapping[str, str], difficulty: int, facts: Mapping[str, str]) -> str:
    if difficulty == 1:
        content = files[f"/etc/{facts['app']}/config.ini"]
        return re.search(rf"^{facts['key']}=(.*)$", content, re.M).group(1)
    if difficulty == 2:
        return next(p for p, c in sorted(files.items()) if facts["code"] in c and p.startswith("/var/log/"))
    return facts["token"]


class TerminalEnv(api.ToolEnvironment):
    name = "terminal"
    in_process_safe = True  # pure Python, no policy code run: env.service='auto' keeps it in process
    difficulties = (1, 2, 3)

    def __init__(self, *, max_turns: int = 6, reward_weights: Mapping[str, float] | None = None):
        super().__init__(max_turns=max_turns, reward_weights=reward_weights)
        self._files: dict[str, str] = {}

    def sample_task(self, seed: int, difficulty: int) -> api.Task:
        if difficulty not in self.difficulties:
            raise ValueError(f"terminal difficulty {difficulty} not in {list(self.difficulties)}")
        files, facts = build_fs(seed, difficulty)
        return api.Task(id=f"terminal/{difficulty}/{seed}", env=self.name, prompt=_prompt(difficulty, facts), tools=TOOLS,
                        verifier={"fs_seed": seed, "answer": _answer(files, difficulty, facts)}, difficulty=difficulty)

    def start_episode(self, task: api.Task, seed: int) -> None:
        self._files, _ = build_fs(int(task.verifier["fs_seed"]), task.difficulty)

    def tools(self):
        return TOOLS

    def _dir(self, path: str) -> str:
        path = posixpath.normpath("/" + path.strip().lstrip("/"))
        return "/" if path == "/" else path.rstrip("/")

    def _under(self, root: str):
        prefix = root if root.endswith("/") else root + "/"
        return [p for p in sorted(self._files) if p.startswith(prefix)]

    def call_tool(self, name: str, arguments: Mapping[str, Any]) -> str:
        path = self._dir(arguments["path"])
        if name == "cat":
            if path not in self._files:
                raise api.ToolError(f"cat: {path}: No such file")
            return self._files[path][:MAX_OUTPUT_CHARS]
        under = self._under(path)
        if not under and path not in self._files:
            raise api.ToolError(f"{name}: {path}: No such file or directory")
        if name == "ls":
            depth = 0 if path == "/" else path.count("/")
            children = sorted({p.split("/")[depth + 1] + ("/" if p.count("/") > depth + 1 else "") for p in under})
            return "\n".join(children)
        if name == "grep":
            pattern = arguments["pattern"]
            if not pattern:
                raise api.ToolError("grep: empty pattern")
            hits = [f"{p}:{line}" for p in (under or [path]) for line in self._files[p].splitlines() if pattern in line]
            return ("\n".join(hits) or "no matches")[:MAX_OUTPUT_CHARS]
        hits = [p for p in under if arguments["name"] in posixpath.basename(p)]
        return ("\n".join(hits) or "no matches")[:MAX_OUTPUT_CHARS]

    def verify(self, answer: str) -> bool:
        return answer.strip() == str(self.task.verifier["answer"])


def _call(tool, **arguments):
    return tp.format_tool_call(tp.ToolCall(tool, arguments))


def _result(observation: str) -> str:
    return observation.removeprefix(tp.RESULT_OPEN).removesuffix(tp.RESULT_CLOSE)


def expert(task: api.Task, observations, actions) -> str:
    """cat the config / grep the logs / find then cat the secret, reading each tool result."""
    prompt = task.prompt
    if task.difficulty == 1:
        key, path = re.search(r"value of (\w+) in (\S+)\?", prompt).groups()
        if not actions:
            return _call("cat", path=path)
        return tp.format_answer(re.search(rf"^{key}=(.*)$", _result(observations[-1]), re.M).group(1))
    if task.difficulty == 2:
        code = re.search(r"error (E\d+)", prompt).group(1)
        if not actions:
            return _call("grep", pattern=code, path="/var/log")
        return tp.format_answer(_result(observations[-1]).splitlines()[0].split(":")[0])
    prefix = re.search(r"starts with (\S+) is", prompt).group(1)
    if not actions:
        return _call("find", name=prefix, path="/srv")
    if len(actions) == 1:
        return _call("cat", path=_result(observations[-1]).splitlines()[0])
    return tp.format_answer(re.search(r"token=(\w+)", _result(observations[-1])).group(1))


api.register(TerminalEnv.name, TerminalEnv, expert=expert)
