"""A deterministic, locally generated training corpus for the tiny model's BPE tokenizer.

Mixes the text an agent model sees: English prose, Python and shell, JSON, file paths,
and chat turns with tool calls. Same seed, same text, on every machine (no I/O, no clock).
"""

from __future__ import annotations

import json
import random

_WORD_TEXT = (
    "the a an of to in and is that for it on with as was be by this are or from at have not "
    "file files directory test tests run running error errors value values function call "
    "result results return list read write open close create delete update change changes "
    "code line lines output input command commands build install package module import "
    "data string number true false null user assistant system tool tools model server "
    "request response session task agent step check fix bug issue patch repository branch "
    "commit merge status config path name type object array key index count size time "
    "first last next previous new old all any each some more less same different good bad "
    "please can could would should will must may might need want use used using make made "
    "find found search show print log logs debug info warning we you they he she i my your "
    "what why how when where which who here there now then because if else while until "
    "work works working done start stop wait ready method class def self args kwargs "
    "about above after again against around away back before below between both during "
    "every few great group hand high home house important information keep kind large "
    "left life little long look man men money mother never night number often part people "
    "place point problem program public question right room school second seem several "
    "small sound still story study such system take than thing think those though thought "
    "three through today together too turn under until very water way well went were world "
    "year young always answer area become begin body book bring brought car carry city "
    "close color country cover cross cut dark day deep door down draw early earth east eat "
    "end enough even example eye face fact family far feel field fire fish follow food form "
    "four free friend front full game give go gold government green grow half happen hard "
    "head hear heard help hold horse hot hour idea inside island job just king knew know land "
    "language late laugh lay lead learn letter light like line listen live mark matter mean "
    "measure mind minute miss moon morning mountain move music near note nothing notice "
    "order paper pass pattern perhaps picture piece plan plant play power press pull question "
    "quick rain reach real reason record red remember rest river road rock round rule science "
    "sea set shape short side simple since sing size sleep slow snow song soon space speak "
    "special stand star state stay store street strong subject sun sure surface table tail "
    "talk teach tell ten test than thousand told town travel tree true try unit upon usual "
    "voice vowel walk warm watch weather weight west wheel white whole wind window winter "
    "wish wonder wood word yes yet parse token tokens batch queue cache weight weights version "
    "sample sampling logits prompt completion stream event events registry scheduler runtime "
    "sandbox container docker image network timeout deadline retry backoff metrics health"
)
_SHORT_LISTS = {
    "syllables": "ka ri to mu sen lo vi da pe zu gor an el in on ex ter pro con ment tion ble ly",
    "names": "main utils config server client parser handler worker engine model app test",
    "exts": "py js ts rs go md json yaml toml txt sh",
}
WORDS = tuple(_WORD_TEXT.split())

SYLLABLES = tuple(_SHORT_LISTS["syllables"].split())

NAMES = tuple(_SHORT_LISTS["names"].split())
EXTS = tuple(_SHORT_LISTS["exts"].split())
SHELL = (
    "ls -la {d}",
    "cat {f}",
    "grep -rn '{w}' {d}",
    "python -m pytest {d} -q",
    "git status",
    "git diff {f}",
    "git log --oneline -n {n}",
    "mkdir -p {d}/{w}",
    "rm -rf {d}/build",
    "sed -n '{n},{m}p' {f}",
    "pip install {w}",
    'echo "{w} {w2}" > {f}',
    "find {d} -name '*.{e}'",
    "cd {d} && make test",
    "wc -l {f}",
)


def _path(rng: random.Random) -> str:
    parts = [rng.choice(NAMES) for _ in range(rng.randint(1, 3))]
    return "/".join(parts) + "." + rng.choice(EXTS)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(".!?:.")


def _python(rng: random.Random) -> str:
    name, arg, other = rng.choice(NAMES), rng.choice(WORDS), rng.choice(WORDS)
    n = rng.randint(0, 99)
    return (
        f"def {name}_{other}({arg}, n={n}):\n"
        f'    """{_sentence(rng)}"""\n'
        f"    if {arg} is None:\n"
        f'        raise ValueError("{arg} must not be None")\n'
        f"    result = [{arg}[i] * {n} for i in range(len({arg}))]\n"
        f"    return {{'{other}': result, 'count': len(result)}}\n"
    )


def _shell(rng: random.Random) -> str:
    template = rng.choice(SHELL)
    n = rng.randint(1, 200)
    return template.format(
        d=_path(rng).rsplit("/", 1)[0],
        f=_path(rng),
        w=rng.choice(WORDS),
        w2=rng.choice(WORDS),
        n=n,
        m=n + rng.randint(1, 50),
        e=rng.choice(EXTS),
    )


def _json_value(rng: random.Random, depth: int = 0):
    kind = rng.randint(0, 5 if depth < 2 else 3)
    if kind == 0:
        return rng.randint(-1000, 100000)
    if kind == 1:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return _path(rng)
    if kind == 4:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(WORDS): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}


def _tool_turn(rng: random.Random) -> str:
    name = rng.choice(("bash", "read_file", "write_file", "search", "list_dir", "apply_patch"))
    args = {"command": _shell(rng)} if name == "bash" else {"path": _path(rng)}
    if rng.random() < 0.3:
        args["content"] = _sentence(rng)
    call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    xml = f"<function={name}>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items()
    )
    body = call if rng.random() < 0.8 else xml + "</function>"
    thought = f"<think>\n{_sentence(rng)}\n</think>\n\n" if rng.random() < 0.3 else ""
    result = json.dumps(_json_value(rng), ensure_ascii=False)
    return (
        f"user\n{_sentence(rng)}\nassistant\n{thought}{_sentence(rng)}\n"
        f"<tool_call>\n{body}\n</tool_call>\nuser\n<tool_response>\n{result}\n</tool_response>\n"
    )


def _identifiers(rng: random.Random) -> str:
    out = []
    for _ in range(rng.randint(3, 10)):
        parts = [rng.choice(WORDS) for _ in range(rng.randint(2, 3))]
        style = rng.randint(0, 3)
        if style == 0:
            out.append("_".join(parts))
        elif style == 1:
            out.append(parts[0] + "".join(p.capitalize() for p in parts[1:]))
        elif style == 2:
            out.append("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))))
        else:
            out.append(f"{parts[0]}{rng.randint(0, 9999)}")
    return " ".join(out)


def generate_corpus(seed: int = 0, documents: int = 12000) -> list[str]:
    """``documents`` short texts of mixed kinds, reproducible from ``seed``."""
    rng = random.Random(seed)
    makers = (
        lambda: " ".join(_sentence(rng) for _ in range(rng.randint(1, 5))),
        lambda: _python(rng),
        lambda: "\n".join(_shell(rng) for _ in range(rng.randint(1, 4))),
        lambda: json.dumps(_json_value(rng), ensure_ascii=False, indent=rng.choice([None, 2])),
        lambda: _tool_turn(rng),
        lambda: _identifiers(rng),
    )
    return [makers[i % len(makers)]() for i in range(documents)]
