"""Constrained generation: gen_int, a regex gen and a JSON-schema gen."""

import json

from _common import make_backend, parse_args

import frontend_dsl as sgl

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@sgl.function
def constrained(s, max_tokens):
    s += "Q: How many legs does a spider have?\nA: " + sgl.gen_int("legs", max_tokens=4) + "\n"
    s += "Q: Give an IP address.\nA: "
    s += sgl.gen("ip", regex=r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
                 max_tokens=16) + "\n"
    s += "Describe a person as JSON: "
    # the JSON needs room to close: a length cut would leave it unparseable
    s += sgl.gen("person", json_schema=PERSON, max_tokens=max(max_tokens, 48), temperature=0)


def main() -> None:
    args = parse_args(__doc__, max_tokens=40)
    backend = make_backend(args)
    state = constrained.run(max_tokens=args.max_tokens, temperature=0)
    print("legs:", int(state["legs"]))
    print("ip:", state["ip"])
    print("person:", json.loads(state["person"]))
    backend.shutdown()


if __name__ == "__main__":
    main()
