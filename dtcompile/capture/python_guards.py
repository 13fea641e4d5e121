"""What a :class:`~.python_state.PythonState` is used for once the call is traced: the
values the traced code rebound put back, the module attributes the forward assigns
noted, and the reads split into the prologue's two sets of guards."""

from __future__ import annotations

import types

import torch

from .code_ran import found_for
from .python_reads import ABSENT, PythonGuards, Read
from .user_code import is_library


class AfterTracing:
    """The methods of ``PythonState`` used after tracing (its ``reads``, ``namespaces``,
    ``_classes``, ``_assigned_names`` and ``_attribute_loads``)."""

    def forget(self, keep) -> None:
        """Drop the reads for which ``keep(read)`` is false."""
        self.reads = [read for read in self.reads if keep(read)]

    def put_back_changed(self) -> list[str]:
        """Where the traced code rebound a value it can read (``global COUNTER; COUNTER +=
        1``, a class attribute, a closure variable): that happens once, while tracing, and
        the program bakes in what it read. Each is put back as it was."""
        changed = [read for read in self.reads if not read.contents and not read.unchanged()]
        plain = (str, int, float, bool)
        self._set_once = [r for r in changed if (r.value is None or r.value is ABSENT) and type(r.current()) in plain]
        for read in changed:
            klass = self._classes.get(id(read.holder))
            if read.key is None and isinstance(getattr(type(read.holder), read.attribute, None), property):
                continue  # (what a cached function returns: evicted by the call's own calls, it cannot be)
            if read.key is None:
                setattr(read.holder, read.attribute, read.value)
            elif klass is not None:  # through the class, so that its method caches see it
                if read.value is ABSENT:
                    delattr(klass, read.key)
                else:
                    setattr(klass, read.key, read.value)
            elif read.value is ABSENT:
                read.holder.pop(read.key, None)
            else:
                read.holder[read.key] = read.value
        return [read.where for read in changed]

    def changes_put_back(self, changed: list[str]) -> tuple[list[str], list[str]]:
        """``changed`` with where the traced code rebound a value (put back: see
        :meth:`put_back_changed`), and apart, where each it set from None (or unset) to a
        plain constant (``if cfg.mode is None: cfg.mode = "x"``), if all were: a first
        call's setup, which one eager run makes as eager's first call does."""
        rebound, reads = self.put_back_changed(), self._set_once
        if rebound and len(reads) == len(rebound):
            return changed, [f"set {read.where} from None" for read in reads]
        return changed + rebound, []

    def after_tracing(self, module_updates: list, recording) -> None:
        """The guards only the traced call tells: what the forward assigns
        (:meth:`forget_assigned`), the closed-over tensors' ``.grad`` it read, the names of
        the user classes followed where code loads a ``__name__`` or ``__qualname__``
        (``type(self).__name__ == "Block"``; they live in the class object, not its dict);
        what tracing ran of the registrations of each op of the user's it called
        (``symbols``, however it reached them: :meth:`traced_registrations`)."""
        self.forget_assigned(module_updates)
        self.guard_grads(recording.grad_reads)
        symbols = recording.bound_symbols
        for name in ("__name__", "__qualname__"):
            if name in self._attribute_loads:
                for klass in self._classes.values():
                    self._read(
                        klass, None, getattr(klass, name), f"the {name} of class {klass.__qualname__}", attribute=name
                    )
        for name in sorted({str(s.op._name) for s in symbols if s.op is not None and s.op.namespace != "aten"}):
            self.traced_registrations(name)
        self.code_ran_unfollowed(getattr(recording, "code_ran", None))

    def code_ran_unfollowed(self, code_ran) -> None:
        """Each user function that library code called while tracing and nothing the code
        reads names (``code_ran.py``): followed, and the tables holding it guarded."""
        walked = {id(value.__code__) for value in self._held if isinstance(value, types.FunctionType)}
        for code in code_ran.entries if code_ran is not None else ():
            if id(code) in walked:
                continue
            for function, tables in found_for(code):
                where = f"{function.__qualname__}, which library code called"
                self.follow(function, where)
                for table, key in tables:
                    self._read(table, key, function, f"the entry {key!r} holding {where}")

    def traced_registrations(self, name: str) -> None:
        """The functions registered for the op ``name`` that tracing ran: its fake kernels
        (``register_fake``: they size its outputs), and a ``custom_op``'s backward and
        ``setup_context`` (``register_autograd``: a new registration is seen by identity).
        Not its kernel, which the program runs as one op at each call."""
        entry = torch._library.simple_registry.singleton.find(name)
        for kernel in entry.fake_impl.kernels:  # (torch may wrap it: ``_check_pystubs_once``'s closure holds it)
            wrapped = is_library(kernel.func) and getattr(kernel.func, "__closure__", None) or ()
            for function in [cell.cell_contents for cell in wrapped] or [kernel.func]:
                self.follow(function, f"the fake kernel of {name}")
        definition = torch._library.custom_ops.OPDEFS.get(name)
        for holder in [definition] if definition is not None else _autograd_infos(name):
            for attribute in ("_backward_fn", "_setup_context_fn"):
                function = getattr(holder, attribute, None)
                self._read(holder, None, function, f"the {attribute[1:-3]} of {name}", attribute=attribute)
                self.follow(function, f"the {attribute[1:-3]} of {name}")

    def guard_grads(self, reads: list) -> None:
        """Guard the ``.grad`` of each closed-over tensor the code read: the program holds it."""
        for tensor, grad in reads:
            self._read(tensor, None, grad, "the .grad of a tensor the call closes over", attribute="grad")

    def forget_assigned(self, module_updates: list) -> None:
        """Note the module attributes the forward assigns (``ModuleUpdate``\\ s, made
        again after each call), which the namespaces' lengths do not count. What one held
        before the call stays guarded where the program may have read it (``if self.cache
        is None``, ``self.pos + n``, ``hasattr(self, "cache")``): another value compiles a
        new entry. Not guarded: an attribute no code loads by name (``self.last = n * 2``
        in user classes whose code never loads ``last``), which would compile at every call,
        once it exists (absent before, it is guarded absent: ``getattr(self, f"s{i}", None)``)."""
        unread = {
            (id(vars(u.module)), u.key)
            for u in module_updates
            if u.table == "__dict__"
            and not self._attribute_loads & {u.key, "*"}  # ("*": the code iterates ``vars(self)``)
            and not any(map(is_library, type(u.module).__mro__[: type(u.module).__mro__.index(torch.nn.Module)]))
            # Absent before the call, it stays guarded: a name made at run time
            # (``getattr(self, f"state_{i}", None)``) may read it; the next call compiles
            # once more, with what this call assigned.
            and u.key in vars(u.module)
        }
        self.forget(lambda read: (id(read.holder), read.key) not in unread)
        for u in module_updates:
            if u.table == "__dict__":
                self._assigned_names[(id(vars(u.module)), u.key)] = None
                if (id(vars(u.module)), u.key) not in unread:  # absent before: ``hasattr`` was False
                    self._read(
                        vars(u.module), u.key, vars(u.module).get(u.key, ABSENT), f"attribute {u.key!r} of {u.path}"
                    )

    def namespace_lengths(self) -> list[tuple[int, tuple[str, ...]]]:
        """How many names each namespace holds, not counting the names the forward assigns
        or removes (the epilogue does so after each call), and those names."""
        lengths = []
        for names in self.namespaces:
            assigned = tuple(key for holder, key in self._assigned_names if holder == id(names))
            lengths.append((len(names) - sum(key in names for key in assigned), assigned))
        return lengths

    def guards(self) -> tuple[PythonGuards, PythonGuards]:
        """The guards of the reads in two sets. First, a scalar or an object read from a
        dict the forward does not assign to: the dict at an unchanged version holds the
        same, so the prologue checks these only when a dict they read changed. Then the
        rest, checked at every call: attributes outside dicts (cells, defaults), the
        contents of containers, and what is read from dicts the epilogue writes to. The
        namespaces' lengths go with them alike."""
        lengths = self.namespace_lengths()
        assigned_to = {id(names) for names, (_, assigned) in zip(self.namespaces, lengths) if assigned}

        def versioned(read: Read) -> bool:
            return read.key is not None and not read.contents and id(read.holder) not in assigned_to

        first = PythonGuards.of([read for read in self.reads if versioned(read)])
        rest = PythonGuards.of([read for read in self.reads if not versioned(read)])
        for names, length in zip(self.namespaces, lengths):
            guards = rest if id(names) in assigned_to else first
            guards.namespaces.append(names)
            guards.namespace_lengths.append(length)
        return first, rest


def _autograd_infos(name: str) -> list:
    """What ``torch.library.register_autograd`` gave for the ``Library`` op ``name``: the
    ``Info`` (backward, setup_context) in the closure of the autograd Function torch made
    for it, named after the op. Torch holds the kernel in C++ only; its Function class is
    found among ``torch.autograd.Function``'s subclasses (an earlier registration's too,
    while alive: its reads guarded as well, which can only cost a compile)."""
    prefix = "GeneratedBackwardFor_" + name.replace("::", "_") + "_"
    infos = []
    for function_class in torch.autograd.Function.__subclasses__():
        if function_class.__name__.startswith(prefix):
            backward = function_class.__dict__.get("backward")
            backward = getattr(backward, "__func__", backward)
            cells = dict(zip(backward.__code__.co_freevars, backward.__closure__ or ()))
            if "info" in cells:
                infos.append(cells["info"].cell_contents)
    return infos
