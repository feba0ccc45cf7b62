"""``cupy-dsa needle``: needle-in-a-haystack recall of a running OpenAI-compatible server (SGLang's
``/v1/chat/completions``).

A prompt is an instruction, a haystack of seeded filler sentences with one needle sentence ("The secret number
of the copper lantern is 4817203.") at a chosen depth, and the question for that number. Context lengths are
counted in the server's own tokens: before the sweep the filler size of every length is calibrated from the
``usage.prompt_tokens`` the server reports (requests of one output token), and every answer's
``prompt_tokens`` is kept. Decoding is greedy (temperature 0); a trial counts as found when the answer contains
the number. Recall per (length, depth) over ``trials`` needles, each with its own filler, key and number.

With ``residues`` every prompt also runs padded by 1, 2 and 3 tokens (after the filler, or just before the needle),
so each residue of the length mod 4 is covered (the C4 compressor folds 4 tokens into one index key; vLLM #55927 saw
DeepSeek-V4-Flash lose a deep needle's last digit at 3 mod 4); each answer's residue is the server's own count's, and
a residue that loses needles the other residues of the same prompt keep is flagged. A sweep the server drops keeps
its finished trials (``incomplete``) and resumes from its file.

This is what a served model retrieves, end to end: the indexer is one of many places a long context can lose a
fact. Run it against the same model served with different index-key modes (``--label`` each run) and overlay
the runs with ``cupy-dsa bench report a.json b.json``.

Requests go through the ``openai`` client (the ``needle`` extra: ``pip install -e '.[needle]'`` in the checkout;
SGLang's environment has it already); nothing here speaks HTTP itself.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

SCHEMA = "cupy-dsa-needle/1"
DEFAULT_BASE_URL = "http://127.0.0.1:30000/v1"   # SGLang's default port
DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

# Calibration: a length is reached when the measured prompt is within this many tokens (or this fraction) of it.
CAL_TOLERANCE_TOKENS = 16
CAL_TOLERANCE_FRACTION = 0.005
CAL_MAX_STEPS = 6
# Output tokens of a calibration request (the server must generate at least one).
CAL_MAX_TOKENS = 1


class NeedleError(Exception):
    """A run that cannot go on, with a message for the operator (no traceback).

    ``option`` names the command-line option whose value the server refused (``--model``, ``--lengths``), so the
    command line can report it as a usage error; None for a failure of the server or the network."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


# --------------------------------------------------------------------------------------------------
# The haystack
# --------------------------------------------------------------------------------------------------

# Filler vocabulary: plain words, no digits (the needle's number is the only one in the prompt).
_ADJ = ("quiet", "narrow", "old", "patient", "distant", "gentle", "crowded", "faded", "bright", "hollow",
        "steady", "curious", "heavy", "silver", "windy", "modest", "careful", "golden", "muddy", "tall")
_SUBJ = ("fisherman", "baker", "river", "mountain road", "library", "gardener", "market", "train", "orchard",
         "lighthouse keeper", "village choir", "weaver", "bridge", "harbour", "teacher", "shepherd", "mill",
         "traveller", "potter", "ferry")
_VERB = ("watched", "carried", "followed", "painted", "remembered", "described", "repaired", "passed",
         "gathered", "measured", "visited", "crossed", "studied", "sheltered", "counted", "greeted")
_OBJ = ("the morning fog", "a basket of apples", "the slow clouds", "an empty cart", "the evening bells",
        "a row of lanterns", "the long shadows", "a pile of letters", "the frozen pond", "a flock of geese",
        "the narrow stairs", "a bundle of reeds", "the old map", "a cup of tea", "the summer rain")
_TAIL = ("before the market opened.", "near the edge of the forest.", "while the wind changed direction.",
         "as the tide went out.", "without saying a word.", "long after sunset.", "under a grey sky.",
         "along the winding path.", "beside the stone wall.", "in the middle of the afternoon.",
         "while the kettle boiled.", "at the end of the season.")
_KEY_ADJ = ("copper", "velvet", "emerald", "crimson", "marble", "amber", "cobalt", "ivory", "scarlet", "bronze")
_KEY_NOUN = ("lantern", "compass", "teapot", "violin", "telescope", "hourglass", "umbrella", "kite", "anchor",
             "typewriter")

# --residues pads a prompt by 1-3 tokens: the first of these units that the server counts as exactly one token
# per copy, at the pad's place, is used (no digits: the needle's number stays the only one in the prompt)
PAD_UNITS = (" .", " ok", " -", " the")
PAD_AT = ("end", "needle")
# The C4 compressor folds 4 raw tokens into one index key: a prompt's length mod 4 decides how full its last,
# partial group is (the residue every length of a --residues sweep covers)
RESIDUE_MOD = 4
# A residue is flagged when it missed at least this many needles that every other residue of the same prompt
# found, and more than twice as many as any other residue missed alone (one odd miss is noise)
RESIDUE_FLAG_MIN_LOST = 2
RESIDUE_FLAG_TEXT = "depends on the prompt length mod 4: not the index keys' precision alone"

INSTRUCTION = ("Below is a long text. Somewhere in it is one sentence that gives a secret number. Read the text, "
               "then answer the question that follows it.")


def _sentence(rng: random.Random) -> str:
    return f"The {rng.choice(_ADJ)} {rng.choice(_SUBJ)} {rng.choice(_VERB)} {rng.choice(_OBJ)} {rng.choice(_TAIL)}"


@dataclass(frozen=True)
class Needle:
    key: str      # "the copper lantern"
    value: str    # seven digits, no leading zero

    @property
    def sentence(self) -> str:
        return f"The secret number of {self.key} is {self.value}."

    @property
    def question(self) -> str:
        return f"What is the secret number of {self.key}? Answer with the number only."


def needle_for(seed: int, trial: int) -> Needle:
    """The needle of a trial: the same in every (length, depth) cell, so cells differ only in where it sits."""
    rng = random.Random(f"needle/{seed}/{trial}")
    return Needle(f"the {rng.choice(_KEY_ADJ)} {rng.choice(_KEY_NOUN)}", str(rng.randrange(10**6, 10**7)))


def filler(seed: int, trial: int, n_words: int) -> list[str]:
    """Whole sentences of a trial's filler, the first ``n_words`` words or just over (a stream: a longer filler
    starts with the shorter one)."""
    rng = random.Random(f"filler/{seed}/{trial}")
    out, words = [], 0
    while words < n_words:
        s = _sentence(rng)
        out.append(s)
        words += len(s.split())
    return out


def haystack(seed: int, trial: int, n_words: int, depth: float, *, pad: int = 0, pad_at: str = "end",
             pad_unit: str = PAD_UNITS[0]) -> tuple[str, Needle]:
    """The user message of one trial: instruction, filler with the needle after ``round(depth * sentences)``
    filler sentences (0 = first sentence, 1 = last), question. ``pad`` copies of ``pad_unit`` (one server token
    each, see :func:`calibrate_pad`) go after the filler (``pad_at="end"``: the needle keeps its position from
    the start) or just before the needle (``"needle"``: it keeps its distance from the end)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a fraction in [0, 1], got {depth!r}")
    if pad_at not in PAD_AT:
        raise ValueError(f"pad_at: expected one of {', '.join(PAD_AT)}, got {pad_at!r}")
    needle = needle_for(seed, trial)
    sentences = filler(seed, trial, n_words)
    at = int(round(depth * len(sentences)))
    padding = pad_unit * pad
    needle_sentence = (padding.lstrip() + " " if pad and pad_at == "needle" else "") + needle.sentence
    body = " ".join(sentences[:at] + [needle_sentence] + sentences[at:])
    if pad and pad_at == "end":
        body += padding
    return f"{INSTRUCTION}\n\n{body}\n\n{needle.question}", needle


def found(answer: str | None, needle: Needle) -> bool:
    """The answer names the needle's number (digit groups may be split by commas, spaces or dots)."""
    if not answer:
        return False
    return needle.value in re.sub(r"(?<=\d)[,.\s\u202f\u00a0_](?=\d)", "", answer)


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------

def normalize_base_url(url: str) -> str:
    """``http(s)://host:port[/path]``; a URL without a path gets ``/v1`` (where SGLang serves the OpenAI API).
    ValueError naming what was expected otherwise."""
    text = str(url).strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL such as {DEFAULT_BASE_URL}, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"expected an http(s) URL with a numeric port such as {DEFAULT_BASE_URL}, got {url!r}") from None
    path = parts.path.rstrip("/")
    return urlunsplit((parts.scheme, parts.netloc, path or "/v1", "", ""))


def openai_module():
    try:
        import openai
    except ImportError:
        raise NeedleError("the needle test talks to the server through the openai client, which is not installed: "
                          "install cupy_dsa's needle extra (pip install -e '.[needle]' in the checkout), or pip install "
                          "openai") from None
    return openai


def make_client(base_url: str, *, api_key: str, timeout: float, retries: int):
    openai = openai_module()
    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=retries)


def _status_message(e) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg)
    return str(getattr(e, "message", None) or e)


_CONTEXT_LIMIT = re.compile(r"context length|longer than|maximum context|too long|exceeds", re.I)


def explain(e: Exception, *, what: str, base_url: str, timeout: float, retries: int) -> NeedleError:
    """An openai client exception as a :class:`NeedleError` an operator can act on."""
    openai = openai_module()
    tries = f"{retries + 1} attempt{'s' if retries else ''}"
    if isinstance(e, openai.APITimeoutError):
        return NeedleError(f"{what}: no answer from {base_url} within --timeout {timeout:g} s ({tries}, "
                           f"--retries {retries}). A long prefill can take minutes: raise --timeout, or check that "
                           f"the server is not stuck.")
    if isinstance(e, openai.APIConnectionError):
        cause = e.__cause__ or e
        return NeedleError(f"{what}: cannot reach the server at {base_url} ({type(cause).__name__}: {cause}; "
                           f"{tries}). Is it running, and is --base-url right?")
    if isinstance(e, openai.AuthenticationError):
        return NeedleError(f"{what}: the server at {base_url} refused the API key (HTTP 401): pass --api-key "
                           f"(or set OPENAI_API_KEY) to the key the server was started with.", option="--api-key")
    if isinstance(e, openai.APIStatusError):
        msg = _status_message(e)
        if e.status_code == 404 and re.search(r"model", msg, re.I):
            return NeedleError(f"{what}: the server at {base_url} does not serve that model (HTTP 404: {msg}). "
                               f"Pass --model with a name from {base_url}/models.", option="--model")
        if e.status_code == 400 and _CONTEXT_LIMIT.search(msg):
            return NeedleError(f"{what}: the server refused the prompt as too long (HTTP 400: {msg}). Lower "
                               f"--lengths to fit the server's context length (--context-length at launch).",
                               option="--lengths")
        hint = " (retried; the server kept failing)" if e.status_code >= 500 and retries else ""
        return NeedleError(f"{what}: the server at {base_url} answered HTTP {e.status_code}{hint}: {msg}")
    if isinstance(e, openai.OpenAIError):
        return NeedleError(f"{what}: {type(e).__name__}: {e}")
    raise e


@dataclass
class Server:
    """The server under test and how to talk to it."""

    base_url: str
    api_key: str = "EMPTY"
    timeout: float = 600.0
    retries: int = 2
    extra_body: dict | None = None
    model: str | None = None
    max_model_len: int | None = None
    listed_models: list = field(default_factory=list)
    client: object = None

    def connect(self, model: str | None) -> None:
        """Open the client and settle the model: ``/v1/models`` lists what the server serves (and its context
        length); a ``model`` it does not list is refused, none given takes the only one served."""
        self.client = make_client(self.base_url, api_key=self.api_key, timeout=self.timeout, retries=self.retries)
        openai = openai_module()
        try:
            cards = list(self.client.models.list())
        except openai.NotFoundError:
            cards = None  # a server without /v1/models: the first chat request tells
        except openai.OpenAIError as e:
            raise self._explain(e, "listing the served models") from None
        if cards is None:
            if not model:
                raise NeedleError(f"{self.base_url}/models answered HTTP 404: check --base-url (SGLang serves the "
                                  f"OpenAI API under /v1), or pass --model for a server without a model listing",
                                  option="--model")
            self.model = model
            return
        self.listed_models = [c.id for c in cards]
        if model is None:
            if len(cards) != 1:
                raise NeedleError(f"the server at {self.base_url} serves {len(cards)} models "
                                  f"({', '.join(self.listed_models) or 'none'}): pick one with --model", option="--model")
            card = cards[0]
        else:
            matches = [c for c in cards if c.id == model]
            if not matches:
                raise NeedleError(f"model {model!r} is not served at {self.base_url}; it serves: "
                                  f"{', '.join(self.listed_models) or 'nothing'}", option="--model")
            card = matches[0]
        self.model = card.id
        mml = getattr(card, "max_model_len", None)
        self.max_model_len = int(mml) if isinstance(mml, (int, float)) and mml > 0 else None

    def _explain(self, e, what):
        return explain(e, what=what, base_url=self.base_url, timeout=self.timeout, retries=self.retries)

    def ask(self, content: str, max_tokens: int, what: str) -> tuple[int, str, str | None]:
        """One greedy chat completion: ``(usage.prompt_tokens, answer text, finish_reason)``."""
        openai = openai_module()
        kw = {"extra_body": self.extra_body} if self.extra_body else {}
        try:
            r = self.client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": content}], temperature=0.0, top_p=1.0,
                max_tokens=max_tokens, n=1, stream=False, **kw)
        except openai.OpenAIError as e:
            raise self._explain(e, what) from None
        usage = getattr(r, "usage", None)
        prompt_tokens = getattr(usage, "prompt_tokens", None)
        if not isinstance(prompt_tokens, int) or prompt_tokens <= 0:
            raise NeedleError(f"{what}: the server's answer has no usage.prompt_tokens; the needle test measures "
                              f"context length in the server's tokens and needs it")
        choices = getattr(r, "choices", None) or []
        message = getattr(choices[0], "message", None) if choices else None
        finish = getattr(choices[0], "finish_reason", None) if choices else None
        return prompt_tokens, (getattr(message, "content", None) or ""), finish


# --------------------------------------------------------------------------------------------------
# Calibration: filler words -> the server's prompt tokens
# --------------------------------------------------------------------------------------------------

def tolerance(length: int) -> int:
    return max(CAL_TOLERANCE_TOKENS, int(CAL_TOLERANCE_FRACTION * length))


def calibrate(measure, lengths, *, on_request=None) -> dict:
    """Filler words per target length, from the server's token counts.

    ``measure(n_words) -> prompt_tokens`` (trial 0, needle at depth 0.5). Two probes give the tokens per word
    and the prompt's fixed part; each length then takes secant steps until its prompt is within
    :func:`tolerance` tokens. Returns ``{"tokens_per_word", "overhead_tokens", "requests", "lengths": {L:
    {"words", "prompt_tokens"}}}``; a length shorter than the prompt without filler is a NeedleError naming
    ``--lengths``."""
    requests = []

    def m(words):
        tokens = measure(words)
        requests.append((words, tokens))
        if on_request:
            on_request()
        return tokens

    lo_words = 64
    hi_words = max(256, min(int(min(lengths) * 0.5), 4096))
    t_lo, t_hi = m(lo_words), m(hi_words)
    # the filler stream is whole sentences, so words are measured from what was sent (filler() rounds up)
    tpw = (t_hi - t_lo) / max(1, hi_words - lo_words)
    if tpw <= 0:
        raise NeedleError(f"calibration: the server counted {t_lo} prompt tokens for {lo_words} filler words and "
                          f"{t_hi} for {hi_words}; usage.prompt_tokens does not grow with the prompt")
    overhead = t_lo - tpw * lo_words
    out = {}
    for L in sorted(lengths):
        if L < overhead + 2 * tpw * 8:
            raise NeedleError(f"--lengths {L}: shorter than the prompt without filler "
                              f"(~{int(math.ceil(overhead))} tokens of this server); use longer lengths",
                              option="--lengths")
        words = max(1, int(round((L - overhead) / tpw)))
        best = None
        for _ in range(CAL_MAX_STEPS):
            tokens = m(words)
            if best is None or abs(tokens - L) < abs(best[1] - L):
                best = (words, tokens)
            if abs(tokens - L) <= tolerance(L):
                break
            # secant on the two nearest measurements around L, else the global slope
            known = sorted(set(requests))
            below = [p for p in known if p[1] <= L]
            above = [p for p in known if p[1] > L]
            slope = tpw
            if below and above and above[0][0] != below[-1][0]:
                slope = max(1e-6, (above[0][1] - below[-1][1]) / (above[0][0] - below[-1][0]))
            step = int(round((L - tokens) / slope))
            words = max(1, words + (step if step else (1 if L > tokens else -1)))
        out[L] = {"words": best[0], "prompt_tokens": best[1]}
    return {"tokens_per_word": tpw, "overhead_tokens": overhead, "requests": len(requests), "lengths": out}


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------

@dataclass
class Settings:
    lengths: tuple
    depths: tuple = DEFAULT_DEPTHS
    trials: int = 3
    seed: int = 0
    max_tokens: int = 64
    concurrency: int = 1
    label: str | None = None
    residues: bool = False   # each prompt also at +1, +2, +3 tokens: every residue mod 4
    pad_at: str = "end"

    @property
    def offsets(self) -> tuple:
        return tuple(range(RESIDUE_MOD)) if self.residues else (0,)


# The settings a resumed run takes from its file: a finished trial is only comparable under the same ones
SWEEP_SETTINGS = ("lengths", "depths", "trials", "seed", "max_tokens", "residues", "pad_at")


class NeedleAborted(NeedleError):
    """The server failed mid-sweep: ``doc`` holds the finished trials and the failure (``doc["incomplete"]``)."""

    def __init__(self, message: str, doc: dict):
        super().__init__(message)
        self.doc = doc


def check_lengths_fit(server: Server, settings: Settings) -> None:
    """Lengths plus the answer's tokens within the server's context length (when ``/v1/models`` states one)."""
    if server.max_model_len is None:
        return
    room = server.max_model_len - settings.max_tokens - (RESIDUE_MOD - 1 if settings.residues else 0)
    over = [L for L in settings.lengths if L > room]
    if over:
        pad = f", less {RESIDUE_MOD - 1} tokens of --residues padding" if settings.residues else ""
        raise NeedleError(f"--lengths {', '.join(str(x) for x in over)}: beyond what {server.model} at "
                          f"{server.base_url} accepts ({server.max_model_len} tokens of context, less --max-tokens "
                          f"{settings.max_tokens} for the answer{pad} = {room}). Lower --lengths or --max-tokens, or "
                          f"start the server with a larger --context-length.", option="--lengths")


def calibrate_pad(measure_padded, pad_at: str) -> str:
    """The first of :data:`PAD_UNITS` that the server counts as one token per copy at ``pad_at``:
    ``measure_padded(unit, pad) -> prompt_tokens`` of a short prompt. NeedleError if none does."""
    seen = {}
    for unit in PAD_UNITS:
        counts = [measure_padded(unit, n) for n in range(RESIDUE_MOD)]
        if all(counts[n] == counts[0] + n for n in range(RESIDUE_MOD)):
            return unit
        seen[unit] = [c - counts[0] for c in counts]
    tried = "; ".join(f"{u!r} x 0-3 -> +{', +'.join(map(str, d))}" for u, d in seen.items())
    raise NeedleError(f"--residues: no padding the server counts as exactly one token per copy at --pad-at "
                      f"{pad_at} ({tried}); try the other --pad-at", option="--pad-at")


def _trial_key(t) -> tuple:
    return (int(t["length"]), float(t["depth"]), int(t["trial"]), int(t.get("offset", 0)))


def resume_settings(doc: dict, name: str) -> dict:
    """The sweep settings of a needle result to resume (ValueError naming ``name`` if it is not one)."""
    check_document(doc, name)
    s = doc["settings"]
    missing = [k for k in SWEEP_SETTINGS if k not in s and k not in ("residues", "pad_at")]
    if missing or not isinstance(doc.get("trials"), list) or "calibration" not in doc:
        raise ValueError(f"{name}: a {SCHEMA} document without its settings, trials or calibration; it cannot be "
                         f"resumed")
    return {"lengths": tuple(s["lengths"]), "depths": tuple(s["depths"]), "trials": s["trials"], "seed": s["seed"],
            "max_tokens": s["max_tokens"], "residues": bool(s.get("residues", False)),
            "pad_at": s.get("pad_at", "end")}


def run(server: Server, settings: Settings, *, progress=None, resume: dict | None = None) -> dict:
    """Calibrate, then ask every (length, depth, trial[, offset]). ``progress(kind, advance=1, total=None)`` reports
    ``"calibrate"`` and ``"ask"`` steps. ``resume``: an earlier, incomplete result of the same settings; its
    calibration and finished trials are kept, only the rest is asked. Returns the result document (schema
    :data:`SCHEMA`); a server failure mid-sweep raises :class:`NeedleAborted` with the finished trials."""
    from . import provenance

    check_lengths_fit(server, settings)
    t0 = time.perf_counter()

    def tick(kind, **kw):
        if progress:
            progress(kind, **kw)

    def measure(words):
        content, _ = haystack(settings.seed, 0, words, 0.5)
        tokens, _, _ = server.ask(content, CAL_MAX_TOKENS, f"calibration ({words} filler words)")
        return tokens

    def measure_padded(unit, pad):
        content, _ = haystack(settings.seed, 0, 64, 0.5, pad=pad, pad_at=settings.pad_at, pad_unit=unit)
        tokens, _, _ = server.ask(content, CAL_MAX_TOKENS, f"padding calibration ({unit!r} x {pad})")
        tick("calibrate")
        return tokens

    if resume is not None:
        cal = {"tokens_per_word": resume["calibration"]["tokens_per_word"],
               "overhead_tokens": resume["calibration"]["overhead_tokens"],
               "requests": resume["calibration"]["requests"],
               "lengths": {int(c["length"]): {"words": c["words"], "prompt_tokens": c["prompt_tokens"]}
                           for c in resume["calibration"]["lengths"]}}
        pad_unit = resume["calibration"].get("pad_unit")
        done = {_trial_key(t): t for t in resume["trials"]}
    else:
        cal = calibrate(measure, settings.lengths, on_request=lambda: tick("calibrate"))
        pad_unit = calibrate_pad(measure_padded, settings.pad_at) if settings.residues else None
        done = {}
    cells = [(L, d, t, o) for L in sorted(settings.lengths) for d in settings.depths for t in range(settings.trials)
             for o in settings.offsets]
    todo = [c for c in cells if c not in done]
    tick("ask", advance=0, total=len(todo))

    def one(cell):
        L, d, t, o = cell
        content, needle = haystack(settings.seed, t, cal["lengths"][L]["words"], d, pad=o, pad_at=settings.pad_at,
                                   pad_unit=pad_unit or PAD_UNITS[0])
        where = f"length {L}{f' +{o}' if o else ''}, depth {d:g}, trial {t}"
        tokens, answer, finish = server.ask(content, settings.max_tokens, where)
        row = {"length": L, "depth": d, "trial": t, "prompt_tokens": tokens, "needle": needle.value,
               "found": found(answer, needle), "finish_reason": finish, "answer": answer[:200]}
        if settings.residues:
            row.update(offset=o, residue=tokens % RESIDUE_MOD)
        return row

    trials = list(done.values())
    failure = None
    try:
        if settings.concurrency <= 1:
            for c in todo:
                trials.append(one(c))
                tick("ask")
        else:
            with concurrent.futures.ThreadPoolExecutor(settings.concurrency) as pool:
                futures = [pool.submit(one, c) for c in todo]
                try:
                    for f in concurrent.futures.as_completed(futures):
                        trials.append(f.result())
                        tick("ask")
                except BaseException:
                    for f in futures:
                        f.cancel()
                    # the requests already in flight still finish: keep the trials they bring
                    kept = {id(t) for t in trials}
                    concurrent.futures.wait([f for f in futures if not f.cancelled()])
                    for f in futures:
                        if not f.cancelled() and f.exception() is None and id(f.result()) not in kept:
                            trials.append(f.result())
                    raise
    except NeedleError as e:
        failure = e
    except KeyboardInterrupt:
        failure = NeedleError("interrupted (Ctrl-C)")
    order = {c: i for i, c in enumerate(cells)}
    trials.sort(key=lambda r: order[_trial_key(r)])
    lengths = sorted(settings.lengths)
    doc = {
        "schema": SCHEMA, **provenance.provenance(),
        "label": settings.label or server.model,
        "server": {"base_url": server.base_url, "model": server.model, "max_model_len": server.max_model_len},
        "settings": {"lengths": lengths, "depths": list(settings.depths), "trials": settings.trials,
                     "seed": settings.seed, "max_tokens": settings.max_tokens, "temperature": 0.0,
                     "extra_body": server.extra_body,
                     **({"residues": True, "pad_at": settings.pad_at} if settings.residues else {})},
        "calibration": {"tokens_per_word": cal["tokens_per_word"], "overhead_tokens": cal["overhead_tokens"],
                        "requests": cal["requests"],
                        "lengths": [{"length": L, **v} for L, v in sorted(cal["lengths"].items())],
                        **({"pad_unit": pad_unit} if settings.residues else {})},
        "cells": summarize(trials, lengths, list(settings.depths)),
        "notes": notes(trials, settings),
        "trials": trials,
        "elapsed_s": time.perf_counter() - t0 + (resume or {}).get("elapsed_s", 0.0),
    }
    if settings.residues:
        doc["residues"] = residue_summary(trials)
    if failure is not None:
        doc["incomplete"] = {"error": str(failure), "trials_done": len(trials), "trials_total": len(cells)}
        raise NeedleAborted(str(failure), doc)
    return doc


def notes(trials, settings: Settings) -> list[str]:
    """What the operator should know before reading the recall: needles missed because the answer ran into
    --max-tokens (a model that reasons first), which says nothing about the index; padded prompts whose length
    the server counted otherwise than asked; a residue that loses what the others keep."""
    out = []
    cut = [t for t in trials if not t["found"] and t.get("finish_reason") == "length"]
    if cut:
        out.append(f"{len(cut)} of {len(trials)} answers stopped at --max-tokens {settings.max_tokens} without the "
                   f"number (counted as missed): raise --max-tokens, or turn the model's reasoning off through its "
                   f"chat template (--extra-body)")
    if settings.residues:
        off = residue_mismatches(trials)
        if off:
            out.append(f"{off} padded prompt(s) were not their unpadded prompt's length + the padding in the server's "
                       f"count (usage.prompt_tokens): their recall is counted under the residue the server counted")
        out += [residue_flag_text(f) for f in residue_flags(trials)]
    return out


def _prompt_groups(trials) -> dict:
    """The padded copies of each prompt: ``{(length, depth, trial): {offset: row}}``."""
    groups: dict = {}
    for t in trials:
        if "offset" in t:
            groups.setdefault((t["length"], t["depth"], t["trial"]), {})[t["offset"]] = t
    return groups


def residue_mismatches(trials) -> int:
    """Padded rows whose prompt_tokens is not the unpadded row's + the offset."""
    n = 0
    for g in _prompt_groups(trials).values():
        if 0 in g:
            n += sum(1 for o, t in g.items() if o and t["prompt_tokens"] != g[0]["prompt_tokens"] + o)
    return n


def residue_summary(trials) -> list[dict]:
    """Per residue of the server's prompt length mod 4: trials, found, recall, and ``lost_alone``, the needles
    this residue missed while every other residue of the same prompt found it (prompts with all 4 residues)."""
    rows = {r: {"residue": r, "trials": 0, "found": 0, "lost_alone": 0} for r in range(RESIDUE_MOD)}
    for t in trials:
        if "residue" in t:
            rows[t["residue"]]["trials"] += 1
            rows[t["residue"]]["found"] += int(t["found"])
    for g in _prompt_groups(trials).values():
        by_residue = {t["residue"]: t["found"] for t in g.values()}
        if len(by_residue) < RESIDUE_MOD:
            continue
        missed = [r for r, f in by_residue.items() if not f]
        if len(missed) == 1:
            rows[missed[0]]["lost_alone"] += 1
    for r in rows.values():
        r["recall"] = r["found"] / r["trials"] if r["trials"] else None
    return list(rows.values())


def residue_flags(trials_or_summary) -> list[dict]:
    """The residues that lose what the other residues keep (see :data:`RESIDUE_FLAG_MIN_LOST`)."""
    rows = trials_or_summary
    if rows and "lost_alone" not in rows[0]:
        rows = residue_summary(rows)
    flags = []
    for r in rows:
        others = max((o["lost_alone"] for o in rows if o["residue"] != r["residue"]), default=0)
        if r["lost_alone"] >= RESIDUE_FLAG_MIN_LOST and r["lost_alone"] > 2 * others:
            flags.append(r)
    return flags


def residue_flag_text(flag: dict) -> str:
    return (f"prompt length {flag['residue']} mod {RESIDUE_MOD} lost {flag['lost_alone']} needle(s) that every other "
            f"residue of the same prompt found: {RESIDUE_FLAG_TEXT}")


def summarize(trials, lengths, depths) -> list[dict]:
    cells = []
    for L in lengths:
        for d in depths:
            ts = [t for t in trials if t["length"] == L and t["depth"] == d]
            n_found = sum(t["found"] for t in ts)
            toks = [t["prompt_tokens"] for t in ts]
            cells.append({"length": L, "depth": d, "trials": len(ts), "found": n_found,
                          "recall": n_found / len(ts) if ts else None,
                          "prompt_tokens_min": min(toks) if toks else None,
                          "prompt_tokens_max": max(toks) if toks else None})
    return cells


# --------------------------------------------------------------------------------------------------
# Documents: checks, tables, markdown, plot (one run or several overlaid)
# --------------------------------------------------------------------------------------------------

def is_needle(doc) -> bool:
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA


def check_document(doc, name: str = "JSON_FILE") -> None:
    """ValueError naming ``name`` unless ``doc`` is a needle result this code can read."""
    if not is_needle(doc):
        raise ValueError(f"{name}: expected schema {SCHEMA!r}, got {doc.get('schema') if isinstance(doc, dict) else doc!r}")
    cells = doc.get("cells")
    if not isinstance(cells, list) or not all(isinstance(c, dict) and {"length", "depth", "trials", "found"} <= set(c)
                                              for c in cells):
        raise ValueError(f"{name}: a {SCHEMA} document whose 'cells' are not a list of length/depth/trials/found rows")
    trials = doc.get("trials", [])
    if not isinstance(trials, list) or not all(
            isinstance(t, dict) and {"length", "depth", "trial", "found", "prompt_tokens"} <= set(t)
            and (("residue" not in t) or (t["residue"] in range(RESIDUE_MOD) and "offset" in t)) for t in trials):
        raise ValueError(f"{name}: a {SCHEMA} document whose 'trials' are not a list of length/depth/trial/found/"
                         f"prompt_tokens rows (with residue 0-{RESIDUE_MOD - 1} and offset in a --residues run)")


def length_recall(doc) -> dict[int, tuple[int, int]]:
    """``{length: (found, trials)}`` over every depth."""
    out: dict[int, list[int]] = {}
    for c in doc["cells"]:
        acc = out.setdefault(int(c["length"]), [0, 0])
        acc[0] += int(c["found"])
        acc[1] += int(c["trials"])
    return {L: (f, n) for L, (f, n) in sorted(out.items())}


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def _ratio(found_: int, n: int) -> str:
    return "—" if n == 0 else f"{found_ / n:.2f} ({found_}/{n})"


def _depth(d) -> str:
    return f"{float(d):.0%}"


def _title(doc) -> str:
    s = doc["server"]
    return f"needle recall — {doc['label']} ({s['model']} at {s['base_url']})"


def table(doc):
    """Rows: depths, then all depths; columns: lengths. Cells: recall (found/trials)."""
    from rich.table import Table

    lengths = doc["settings"]["lengths"]
    t = Table(title=_title(doc), caption=_caption(doc))
    t.add_column("depth", justify="right")
    for L in lengths:
        t.add_column(_k(L), justify="right")
    for d in doc["settings"]["depths"]:
        cells = {c["length"]: c for c in doc["cells"] if c["depth"] == d}
        t.add_row(_depth(d), *(_ratio(cells[L]["found"], cells[L]["trials"]) if L in cells else "—" for L in lengths))
    per = length_recall(doc)
    t.add_row("all", *(_ratio(*per[L]) if L in per else "—" for L in lengths), end_section=True)
    for r, by_length in residue_rows(doc):
        t.add_row(f"len mod {RESIDUE_MOD} = {r}", *(_ratio(*by_length[L]) if L in by_length else "—" for L in lengths))
    return t


def residue_rows(doc) -> list:
    """``[(residue, {length: (found, trials)})]`` over every depth, for a --residues run; [] otherwise."""
    rows = [t for t in doc.get("trials", []) if "residue" in t]
    if not rows:
        return []
    out = []
    for r in range(RESIDUE_MOD):
        by_length: dict = {}
        for t in rows:
            if t["residue"] == r:
                acc = by_length.setdefault(int(t["length"]), [0, 0])
                acc[0] += int(t["found"])
                acc[1] += 1
        out.append((r, {L: tuple(v) for L, v in by_length.items()}))
    return out


def flags(doc) -> list[str]:
    """The residue flags of a --residues run (recomputed from its trials), as the operator reads them."""
    rows = [t for t in doc.get("trials", []) if "residue" in t]
    return [residue_flag_text(f) for f in residue_flags(rows)] if rows else []


def _caption(doc) -> str:
    cal = doc["calibration"]
    s = doc["settings"]
    pad = (f"; each prompt also at +1, +2, +3 tokens (padded at the {s.get('pad_at', 'end')}), 'len mod 4' rows by "
           f"the server's count" if s.get("residues") else "")
    return (f"lengths in the server's tokens (usage.prompt_tokens; {cal['tokens_per_word']:.3f} tokens per filler "
            f"word); greedy, {s['trials']} trial(s) per cell, seed {s['seed']}{pad}")


def overlay_table(docs):
    """One row per length, one column per run: recall over every depth."""
    from rich.table import Table

    lengths = sorted({L for d in docs for L in length_recall(d)})
    t = Table(title="needle recall by context length (all depths)")
    t.add_column("length", justify="right")
    for d in docs:
        t.add_column(d["label"], justify="right")
    per = [length_recall(d) for d in docs]
    for L in lengths:
        t.add_row(_k(L), *(_ratio(*p[L]) if L in p else "—" for p in per))
    return t


def markdown(doc) -> str:
    lengths = doc["settings"]["lengths"]
    lines = [f"**{_title(doc)}**", "", "| depth | " + " | ".join(_k(L) for L in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for d in doc["settings"]["depths"]:
        cells = {c["length"]: c for c in doc["cells"] if c["depth"] == d}
        lines.append(f"| {_depth(d)} | " + " | ".join(_ratio(cells[L]["found"], cells[L]["trials"]) if L in cells
                                                     else "—" for L in lengths) + " |")
    per = length_recall(doc)
    lines.append("| all | " + " | ".join(_ratio(*per[L]) if L in per else "—" for L in lengths) + " |")
    for r, by_length in residue_rows(doc):
        lines.append(f"| len mod {RESIDUE_MOD} = {r} | " + " | ".join(_ratio(*by_length[L]) if L in by_length else "—"
                                                                 for L in lengths) + " |")
    lines += ["", _caption(doc) + "."]
    lines += [f"**Flag**: {f}." for f in flags(doc)]
    if doc.get("incomplete"):
        lines.append(f"**Incomplete**: {incomplete_text(doc)}.")
    return "\n".join(lines + [""])


def incomplete_text(doc) -> str:
    inc = doc["incomplete"]
    return (f"{inc['trials_done']} of {inc['trials_total']} trials finished before the run stopped "
            f"({inc['error']}); `cupy-dsa needle --resume FILE` asks the rest")


def overlay_markdown(docs) -> str:
    lengths = sorted({L for d in docs for L in length_recall(d)})
    per = [length_recall(d) for d in docs]
    lines = ["| length | " + " | ".join(d["label"] for d in docs) + " |", "|---:|" + "---:|" * len(docs)]
    for L in lengths:
        lines.append(f"| {_k(L)} | " + " | ".join(_ratio(*p[L]) if L in p else "—" for p in per) + " |")
    models = sorted({d["server"]["model"] for d in docs})
    lines += ["", f"Needle recall over every depth (found/trials); model(s): {', '.join(models)}."]
    lines += [f"**Flag** ({d['label']}): {f}." for d in docs for f in flags(d)]
    lines += [f"**Incomplete** ({d['label']}): {incomplete_text(d)}." for d in docs if d.get("incomplete")]
    return "\n".join(lines + [""])


def plot(docs, path: str) -> None:
    """Recall (over every depth) against context length, one line per run."""
    if Path(path).suffix.lower() != ".png":
        raise ValueError(f"plot: expected a file name ending in .png (the plot is PNG), got {path!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.4), layout="constrained")
    markers = "osD^vx<>p*"
    styles = ("-", "--", "-.", ":")
    for i, d in enumerate(docs):
        per = length_recall(d)
        xs = [L for L, (_, n) in per.items() if n]
        ys = [per[L][0] / per[L][1] for L in xs]
        # runs with the same recall overlap: earlier runs are drawn thicker and below, later ones thinner, dashed
        # and hollow on top, so every line stays visible
        ax.plot(xs, ys, marker=markers[i % len(markers)], linestyle=styles[i % len(styles)],
                linewidth=max(0.9, 3.2 - 0.7 * i), markersize=max(4.0, 9.0 - 1.5 * i),
                fillstyle="full" if i == 0 else "none", zorder=2 + i, label=d["label"])
    ax.set_xscale("log", base=2)
    lengths = sorted({L for d in docs for L in length_recall(d)})
    if lengths:
        ax.set_xticks(lengths, [_k(L) for L in lengths])
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("context length (server tokens)")
    ax.set_ylabel("needle recall (all depths)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left")
    models = ", ".join(sorted({d["server"]["model"] for d in docs}))
    ax.set_title(f"cupy-dsa needle — {models}", fontsize=10)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def write_json(doc: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
