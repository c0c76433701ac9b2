// The pause panel: a run waiting for an answer (execution:paused) shows its prompt and a
// form for its schema; the answer is sent with POST …/resume.

import { api, errorText } from "./api.js";
import { $, show } from "./dom.js";
import { answerForm } from "./forms.js";
import { queuedLabel } from "./format.js";
import { setStatus } from "./panel.js";

export function showPause(run, pause) {
  run.pause = pause;
  $("pause-block").textContent = `(block ${pause.blockId})`;
  $("pause-prompt").textContent = pause.prompt || "";
  show($("pause-error"), false);
  const form = answerForm($("pause-fields"), pause.schema || {});
  $("pause-submit").textContent = form.approval ? "Approve" : "Submit";
  show($("pause-reject"), form.approval);
  run.readPause = form.read;
  setPauseBusy(false);
  show($("pause"), true);
}

export function hidePause(run) {
  show($("pause"), false);
  if (run) run.pause = null;
}

function setPauseBusy(busy) {
  $("pause-submit").disabled = busy;
  $("pause-reject").disabled = busy;
}

/** Send the answer typed for `run`'s pause (`approved` for Approve or Reject). */
export async function resume(run, approved) {
  if (!run || !run.pause) return;
  const problem = $("pause-error");
  show(problem, false);
  let input;
  try {
    input = run.readPause(approved);
  } catch (error) {
    problem.textContent = `The answer is not valid JSON: ${error.message}`;
    show(problem, true);
    return;
  }
  setPauseBusy(true);
  try {
    const response = await api(`/api/executions/${run.id}/resume`, {
      method: "POST",
      body: JSON.stringify({ blockId: run.pause.blockId, input }),
    });
    if (response.status !== 202) {
      problem.textContent = await errorText(response);
      show(problem, true);
      setPauseBusy(false);
      return;
    }
    // On 202 the form goes away when execution:resumed arrives on the stream; an answer
    // that waits in line for a worker (queued) says so until then.
    const answer = await response.json();
    if (answer.status === "queued") {
      run.place = queuedLabel(answer.ahead);
      run.answerWaits = true;
      hidePause(run);
      setStatus(run, "queued", run.place);
    }
  } catch (error) {
    problem.textContent = `Cannot resume: ${error.message}`;
    show(problem, true);
    setPauseBusy(false);
  }
}
