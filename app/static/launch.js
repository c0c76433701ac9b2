// The launch panel: the server's workflows to choose from, and the form that starts one.
// Picking a workflow draws its graph (a preview, before it runs) and fills the input
// with the workflow's `exampleInput` (else `{}`), unless the person typed their own.

import { api, errorText } from "./api.js";
import { $, el, show } from "./dom.js";
import { apiKey } from "./keys.js";

const form = {
  preview: null, // the FlowGraph of the workflow picked (page.js gives it)
  filled: "{}", // the input text this panel wrote last: anything else was typed
  generation: 0, // bumped by every pick, so a late definition fills nothing
};

/** Draw the workflow picked on `graph` from now on. */
export function previewOn(graph) {
  form.preview = graph;
}

/** Fill the workflow list; keeps the choice, else picks `fallback` (the watched run's). */
export async function loadWorkflows(fallback) {
  const select = $("workflow");
  const problem = $("launch-error");
  show(problem, false);
  let response;
  try {
    response = await api("/api/workflows");
  } catch (error) {
    problem.textContent = `Cannot reach the server: ${error.message}`;
    show(problem, true);
    return;
  }
  if (response.status === 401) {
    problem.textContent = "This server needs an API key: enter it above.";
    show(problem, true);
    select.replaceChildren();
    $("api-key").focus();
    return;
  }
  if (!response.ok) {
    problem.textContent = await errorText(response);
    show(problem, true);
    return;
  }
  const { workflows } = await response.json();
  const chosen = select.value || fallback;
  select.replaceChildren(
    ...workflows.map((wf) =>
      el("option", { value: wf.id, text: wf.name ? `${wf.name} (${wf.id})` : wf.id }),
    ),
  );
  select._workflows = new Map(workflows.map((wf) => [wf.id, wf]));
  if (chosen && select._workflows.has(chosen)) select.value = chosen;
  describeWorkflow();
}

export function describeWorkflow() {
  const select = $("workflow");
  const wf = select._workflows && select._workflows.get(select.value);
  $("workflow-description").textContent = wf
    ? `${wf.description || ""} ${wf.blocks} blocks, from ${wf.source}.`.trim()
    : "";
  if (form.preview) form.preview.preview(wf ? wf.id : null);
  prefill(wf ? wf.id : null);
}

// The workflow's example input in the box, unless the box holds what the person typed
// (then it stays: picking another workflow does not throw their input away).
async function prefill(workflowId) {
  const generation = ++form.generation;
  const hint = $("input-hint");
  show(hint, false);
  if (!workflowId) return;
  let definition;
  try {
    definition = await loadDefinition(workflowId);
  } catch {
    return; // the graph says why it cannot be read
  }
  if (generation !== form.generation) return;
  if (definition.inputSchema !== undefined) {
    hint.textContent = `Input schema: ${JSON.stringify(definition.inputSchema)}`;
    show(hint, true);
  }
  const box = $("input");
  // Never under the person's hands: a box they are in (focused) is theirs, whatever it
  // holds (written while they typed, it lost their selection and their text was added
  // to ours: "{}{}").
  if (document.activeElement === box) return;
  if (box.value.trim() !== form.filled.trim() && box.value.trim() !== "{}") return;
  const example = definition.exampleInput !== undefined ? definition.exampleInput : {};
  if (JSON.stringify(example, null, 2) !== box.value) setInput(example);
}

function setInput(value) {
  form.filled = JSON.stringify(value, null, 2);
  $("input").value = form.filled;
}

/** Show `workflowId` as the chosen one, if the list has it (a run of it was attached). */
export function chooseWorkflow(workflowId) {
  const select = $("workflow");
  if (select._workflows && select._workflows.has(workflowId) && select.value !== workflowId) {
    select.value = workflowId;
    describeWorkflow();
  }
}

/** "Run again with this input": the form holds the run's workflow and input, ready to
start; false when the server no longer has that workflow. */
export function fillForm(workflowId, input) {
  const select = $("workflow");
  const problem = $("launch-error");
  if (!select._workflows || !select._workflows.has(workflowId)) {
    problem.textContent = `The workflow ${workflowId} is not on the server any more.`;
    show(problem, true);
    return false;
  }
  show(problem, false);
  form.generation += 1; // a definition still on its way fills nothing now
  if (select.value !== workflowId) {
    select.value = workflowId;
    describeWorkflow();
    form.generation += 1;
  }
  setInput(input === undefined ? null : input);
  return true;
}

/** The start form's submit: starts the chosen workflow, then `opened(executionId, token)`. */
export async function start(event, opened) {
  event.preventDefault();
  const problem = $("launch-error");
  show(problem, false);
  let input;
  try {
    input = JSON.parse($("input").value || "null");
  } catch (error) {
    problem.textContent = `The input is not valid JSON: ${error.message}`;
    show(problem, true);
    return;
  }
  const workflowId = $("workflow").value;
  if (!workflowId) return;
  $("start").disabled = true;
  try {
    const response = await api(`/api/workflows/${encodeURIComponent(workflowId)}/execute`, {
      method: "POST",
      body: JSON.stringify({ input }),
    });
    if (response.status !== 202) {
      problem.textContent = await errorText(response);
      show(problem, true);
      return;
    }
    const started = await response.json();
    // The token only matters when keys are on; without a key it is left out of the URL.
    opened(started.executionId, apiKey() ? started.streamToken : null);
  } catch (error) {
    problem.textContent = `Cannot start: ${error.message}`;
    show(problem, true);
  } finally {
    $("start").disabled = false;
  }
}

/** A workflow's definition, for the graph (its `load`). */
export async function loadDefinition(workflowId) {
  const response = await api(`/api/workflows/${encodeURIComponent(workflowId)}`);
  if (response.status === 401) throw new Error("the workflow can be read with the API key only.");
  if (!response.ok) throw new Error(await errorText(response));
  return response.json();
}
