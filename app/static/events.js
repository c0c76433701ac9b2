// What each event of a run does to the page (the timeline, the status, the pause panel);
// the graph follows the same events by itself (graph.js).

import { $, show } from "./dom.js";
import { formatMs } from "./format.js";
import { chooseWorkflow } from "./launch.js";
import { notice, setStatus, showResult } from "./panel.js";
import { hidePause, showPause } from "./pause.js";
import { blockRow, setBlockStatus } from "./timeline.js";
import { renderValue } from "./values.js";

export const TERMINAL = new Set(["execution:completed", "execution:failed", "execution:cancelled"]);

/** Show `event` on the page of `run`, the run being watched. */
export function apply(run, event) {
  const handle = HANDLERS[event.type];
  if (handle) handle(run, event, event.data || {});
}

const HANDLERS = {
  "execution:started": (run, event) => {
    run.startedAt = Date.parse(event.ts);
    run.workflowId = event.workflowId;
    $("run-workflow").textContent = `workflow ${event.workflowId}`;
    chooseWorkflow(event.workflowId);
    if (!run.answerWaits) setStatus(run, "running");
  },
  "block:started": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    row.startedTs = Date.parse(event.ts);
    row.kind.textContent = data.blockType || "";
    row.attempt.textContent = data.attempt > 1 ? `attempt ${data.attempt}` : "";
    // A block that runs again (a retry, a re-run after execution:recovered) streams
    // from the start: show this run's text, not the runs' texts joined.
    row.chunks.textContent = "";
    show(row.chunks, false);
    show(row.error, false);
    row.duration.textContent = "";
    setBlockStatus(row, "started");
  },
  "block:chunk": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    row.chunks.textContent += data.text;
    show(row.chunks, true);
    setBlockStatus(row, "running");
  },
  "block:completed": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    setBlockStatus(row, "completed");
    row.duration.textContent = formatMs(data.durationMs);
    row.output.replaceChildren(renderValue(run, data.output));
    show(row.output, true);
  },
  "block:failed": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    setBlockStatus(row, data.willRetry ? "retrying" : "failed");
    row.attempt.textContent = `attempt ${data.attempt}`;
    if (row.startedTs !== null) row.duration.textContent = formatMs(Date.parse(event.ts) - row.startedTs);
    const error = data.error || {};
    row.error.textContent = `${error.code || "error"}: ${error.message || ""}`;
    show(row.error, true);
  },
  "block:skipped": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    setBlockStatus(row, "skipped");
    row.error.textContent = data.reason || "";
    row.error.className = "hint";
    show(row.error, Boolean(data.reason));
  },
  "execution:paused": (run, event, data) => {
    const row = blockRow(run, data.blockId, event.ts);
    setBlockStatus(row, "waiting");
    if (run.answerWaits) {
      // Replayed, but answered already: the answer waits in line for a worker (the
      // resume follows once one takes it), so the form is not offered again.
      setStatus(run, "queued", run.place);
      return;
    }
    setStatus(run, "paused");
    showPause(run, data);
  },
  "execution:resumed": (run, event, data) => {
    const row = run.blocks.get(data.blockId);
    if (row) setBlockStatus(row, "resumed");
    hidePause(run);
    run.answerWaits = false;
    setStatus(run, "running");
  },
  "execution:recovered": (run, event, data) => {
    // Not an ending: another process carries the execution on from its checkpoint.
    for (const blockId of data.rerun || []) {
      const row = run.blocks.get(blockId);
      if (row) setBlockStatus(row, "re-run");
    }
    const rerun = (data.rerun || []).length;
    const kept = (data.completed || []).length;
    notice(
      `Recovered (${data.reason}): ${rerun === 1 ? "1 block" : `${rerun} blocks`} re-run, ` +
        `${kept} kept from the checkpoint.`,
      "info",
    );
    setStatus(run, "running");
  },
  "execution:completed": (run, event, data) => {
    setStatus(run, "completed");
    $("run-duration").textContent = `· finished in ${formatMs(data.durationMs)}`;
    showResult(run, "completed", data.output, null);
  },
  "execution:failed": (run, event, data) => {
    setStatus(run, "failed");
    showResult(run, "failed", null, data.error);
  },
  "execution:cancelled": (run, event, data) => {
    setStatus(run, "cancelled");
    hidePause(run);
    showResult(run, "cancelled", null, { message: data.reason || "cancelled" });
  },
};

/** Every event type the stream sends for a run (EventSource listens by name). */
export const EVENT_TYPES = Object.keys(HANDLERS);
