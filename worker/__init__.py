"""What the prefill and decode workers share: the process around an engine (``process``),
its flags (``args``) and the engine's view on the wire (``wire``). Each role's entry is its
own package's ``main``."""
