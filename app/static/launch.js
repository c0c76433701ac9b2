// The launch panel: the server's workflows to choose from, and the form that starts one.

import { api, errorText } from "./api.js";
import { $, el, show } from "./dom.js";
import { apiKey } from "./keys.js";

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
}

/** Show `workflowId` as the chosen one, if the list has it (a run of it was attached). */
export function chooseWorkflow(workflowId) {
  const select = $("workflow");
  if (select._workflows && select._workflows.has(workflowId)) {
    select.value = workflowId;
    describeWorkflow();
  }
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
