"""Serving engines on the host: how to ask them about EAGLE-3 support, start them, load them, and read
their acceptance figures. Standard library only (the engine runs in its own environment)."""


# The common frame of the support probes: a script run with the engine's Python (argv: architecture,
# model_type, and for a wrapped target its text model's architecture) that imports the engine, runs the
# engine's own checks (which append to `reasons`) and prints one JSON line.
_PROBE_HEAD = r'''
import inspect, json, re, sys
arch, model_type = sys.argv[1], sys.argv[2]
text_arch = sys.argv[3] if len(sys.argv) > 3 else arch
out = {"engine": "%(name)s", "architecture": arch, "model_type": model_type}
try:
    import %(name)s as engine
except Exception as e:
    out.update(installed=False, error=f"{type(e).__name__}: {e}")
    print(json.dumps(out)); sys.exit(0)
out.update(installed=True, version=getattr(engine, "__version__", "unknown"))
reasons = []
'''
_PROBE_TAIL = r'''
out["supported"] = not reasons
out["reasons"] = reasons
print(json.dumps(out))
'''


def support_probe(name: str, checks: str) -> str:
    return _PROBE_HEAD % {"name": name} + checks + _PROBE_TAIL
