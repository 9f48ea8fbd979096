"""The built-in two-digit addition task for verl: what ``verl run`` trains on when given no flags.

:mod:`verl_task_arithmetic.addition` builds the task (tokenizer, data, tiny model, warm start);
:mod:`verl_task_arithmetic.plugins` registers it as ``builtin:tiny-qwen2-addition``,
``builtin:addition``, and the ``arithmetic`` reward and environment.

Kept free of imports: verl imports the package only when one of its plugins is used.
"""

__version__ = "0.1.0"
