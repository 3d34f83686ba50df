"""A script-style rank for the edge cases: double replies, unsendable output, a task
dropped without a reply, and the context API."""

import gc

import rankexec

rank = rankexec.init()
while (task := rank.receive()) is not None:
    if task.name == "twice":
        task.reply(meta={"n": 1})
        try:
            task.reply(meta={"n": 2})
        except rankexec.ReplyError as e:
            print("second reply refused:", e, flush=True)
    elif task.name == "unsendable":
        try:
            task.reply(meta={"obj": object()})
        except rankexec.ReplyError as e:
            print("unsendable refused:", e, flush=True)
    elif task.name == "drop":
        del task
        gc.collect()
    elif task.name == "ctx":
        ctx = task.ctx
        seen = {}
        try:
            ctx.set_prop("__rank_number__", 5)
        except rankexec.PropConflict as e:
            seen["conflict"] = str(e)
        ctx.set_prop("mine", [1, "two"], sticky=True)
        seen["mine"] = ctx.get_prop("mine")
        seen["rank_prop"] = ctx.get_prop("__rank_number__")
        seen["missing"] = ctx.get_prop("nope", "default")
        try:
            ctx.fire_event("py_event", {"k": 1})
            seen["fired"] = True
        except rankexec.EventFailed as e:
            seen["fired"] = f"EventFailed: {e}"
        task.reply(meta=seen)
    else:
        task.reply()
