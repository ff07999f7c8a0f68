"""A trainer SIGKILLed right after a snapshot, through the daemon: without
``verify_steps`` the resume has nothing to recompute and says so (a value the loop
forgot to track then goes unnoticed); with
``verify_steps=k`` it resumes from the snapshot before, recomputes and checks the
steps up to the newest one, catches the forgotten value (naming untracked state), and
when everything is tracked ends bit for bit on the uninterrupted run.

The module's seven trainers run in two rounds, each side by side (runs of one root
share only the daemon): the uninterrupted run and three runs SIGKILLed right after
snapshot 8; then the resume of each killed run. Each test reads the runs it names.
Trainers are children forked by the warm parents (warm.py, the ``warm`` fixture): the
resumes by another parent than the runs they are compared with."""

from __future__ import annotations

import glob
import json
import os

import pytest

from harness import UID, Env

TRAINER = r"""
import json, os, signal, sys, torch
from snapd_client import Client
cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

class Carry:  # a hidden state carried from step to step
    value = torch.zeros(())
    def state_dict(self):
        return {"value": self.value}
    def load_state_dict(self, state):
        self.value = state["value"].clone()

carry = Carry()
client = Client(cfg["root"], cfg["run"], **cfg["options"])
client.track(model=model, optimizer=opt)
if cfg["track_carry"]:
    client.track(carry=carry)
step = client.restore()
x = torch.linspace(0, 1, 12).reshape(4, 3)
while step < cfg["steps"]:
    loss = ((model(x).squeeze() + carry.value - 1.0) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    carry.value = 0.5 * carry.value + loss.detach()
    step += 1
    client.log(step, loss=loss.item())
    if step % 4 == 0:
        client.snapshot(step).wait()
        if step == cfg.get("kill_at"):
            os.kill(os.getpid(), signal.SIGKILL)  # right after the snapshot committed
client.close()
print(json.dumps({"weights": model.weight.detach().numpy().tobytes().hex(),
                  "replay": client.journal.verdict}))
"""


# each killed run: whether it tracks the carried value, the options of its resume
KILLED = {"unverified": (False, {}), "forgotten": (False, {"verify_steps": 4}),
          "tracked": (True, {"verify_steps": 4})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, warm):
    """name -> (returncode, stdout, stderr) of the uninterrupted run ("whole") and of
    each killed run's resume."""
    env = Env()
    tmp = tmp_path_factory.mktemp("verify")
    script = tmp / "trainer.py"
    script.write_text(TRAINER)
    names = {name: f"{env.run}-{name}" for name in ["whole", *KILLED]}

    def start(parent, name, output, **cfg):
        return start_trainer(parent, env, str(script), str(tmp / output), names[name],
                             **cfg)
    try:
        whole = start(warm["first"], "whole", "whole", track_carry=True)
        killed = [start(warm["first"], name, f"{name}-killed", track_carry=carry, kill_at=8)
                  for name, (carry, _options) in KILLED.items()]
        done = {"whole": finish(whole)}
        for started in killed:
            finish(started, kill_at=8)
        resumed = {name: start(warm["resumed"], name, name, track_carry=carry,
                               options=options)
                   for name, (carry, options) in KILLED.items()}
        done.update((name, finish(started)) for name, started in resumed.items())
        yield done
    finally:
        env.cleanup()
        for run in names.values():   # hot copies of the runs the daemon still held
            for path in glob.glob(f"/dev/shm/snapd-hot-{UID}-{run}-*"):
                os.unlink(path)


def start_trainer(parent, env, script, output, run, *, track_carry, options=None,
                  kill_at=None):
    """The trainer on ``run``, a child of ``parent``; its stdout and stderr go to
    ``output`` + ".out" / ".err"."""
    cfg = {"root": env.root, "run": run, "steps": 12, "kill_at": kill_at,
           "track_carry": track_carry, "options": options or {}}
    # the real daemon: this module-scoped fixture runs before the function-scoped one
    # that lifts the unit lane's SNAPD_DAEMON=0 (tests/conftest.py)
    env_vars = {k: v for k, v in os.environ.items() if k != "SNAPD_DAEMON"}
    proc = parent.start(script, [json.dumps(cfg)], env_vars, f"{output}.out",
                        f"{output}.err")
    env.pids.add(proc.pid)  # a killed trainer leaves its arena: cleaned up after
    return proc, output


def finish(started, kill_at=None):
    proc, output = started
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
        proc.wait()
    with open(f"{output}.out") as f_out, open(f"{output}.err") as f_err:
        out, err = f_out.read(), f_err.read()
    if kill_at is not None:
        assert proc.returncode == -9, err[-3000:]
    return proc.returncode, out, err


def test_without_verify_steps_a_resume_says_nothing_is_recomputed(runs):
    rc, out, err = runs["unverified"]
    assert rc == 0, err[-3000:]  # the forgotten value goes unnoticed: nothing is wrong
    assert "resuming from step 8 (hot); training had reached 8; nothing to recompute\n" \
        in err
    assert json.loads(out)["replay"] is None


def test_verify_steps_checks_the_steps_and_names_the_forgotten_value(runs):
    rc, _out, err = runs["forgotten"]
    assert rc == 1, err[-3000:]
    assert "resuming from step 4 (disk; not hot: the daemon holds step 8, the restore " \
           "chose step 4); training had reached 8; 4 logged steps will be recomputed " \
           "and checked (verify_steps=4" in err
    assert "ReplayDivergence: replay check: step 5 differs" in err
    assert "(cause scalar:loss)" in err and "First suspect: untracked state" in err


def test_verify_steps_resume_is_bit_for_bit_when_everything_is_tracked(runs):
    rc, whole, err = runs["whole"]
    assert rc == 0, err[-3000:]
    rc, out, err = runs["tracked"]
    assert rc == 0, err[-3000:]
    resumed = json.loads(out)
    assert resumed["weights"] == json.loads(whole)["weights"]
    replay = resumed["replay"]
    assert replay["verdict"] == "match" and (replay["from"], replay["to"]) == (4, 8)
    assert replay["checked"] == 4
