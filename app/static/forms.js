// Forms generated from a JSON schema: a field per property of a simple object schema,
// else a JSON textarea.

import { el } from "./dom.js";

// The property types a generated form handles; anything else gets a JSON textarea.
function simpleProperty(schema) {
  if (!schema || typeof schema !== "object") return false;
  if (Array.isArray(schema.enum)) return schema.enum.every((v) => ["string", "number", "boolean"].includes(typeof v));
  return ["boolean", "string", "number", "integer"].includes(schema.type);
}

function formable(schema) {
  return (
    schema && schema.type === "object" && schema.properties && typeof schema.properties === "object" &&
    Object.values(schema.properties).every(simpleProperty)
  );
}

function hasApproved(schema) {
  return formable(schema) && schema.properties.approved && schema.properties.approved.type === "boolean";
}

function fieldFor(name, schema, required) {
  const id = `field-${name}`;
  const title = schema.title || name;
  const label = el("label", { htmlFor: id },
    title, required ? el("span", { class: "required", title: "required", text: " *" }) : null);
  let input;
  if (Array.isArray(schema.enum)) {
    input = el("select", { id, name });
    if (!required) input.append(el("option", { value: "", text: "—" }));
    schema.enum.forEach((value, index) => input.append(el("option", { value: String(index), text: String(value) })));
    if (schema.default !== undefined) input.value = String(schema.enum.indexOf(schema.default));
  } else if (schema.type === "boolean") {
    input = el("input", { id, name, type: "checkbox", checked: schema.default === true });
  } else if (schema.type === "number" || schema.type === "integer") {
    input = el("input", { id, name, type: "number", step: schema.type === "integer" ? "1" : "any" });
    if (schema.default !== undefined) input.value = String(schema.default);
  } else {
    input = el("input", { id, name, type: "text" });
    if (schema.default !== undefined) input.value = String(schema.default);
  }
  input.required = required && schema.type !== "boolean";
  const help = schema.description ? el("span", { class: "hint", text: schema.description }) : null;
  const wrap = el("div", { class: `field field-${schema.type || "enum"}`, "data-field": name });
  const parts = schema.type === "boolean" ? [input, label, help] : [label, input, help];
  wrap.append(...parts.filter(Boolean));
  return { wrap, read: () => readField(input, schema) };
}

function readField(input, schema) {
  if (Array.isArray(schema.enum)) return input.value === "" ? undefined : schema.enum[Number(input.value)];
  if (schema.type === "boolean") return input.checked;
  if (input.value === "") return undefined;
  // A non-integer typed for an integer is sent as it is, for the schema check to refuse.
  if (schema.type === "integer" || schema.type === "number") return Number(input.value);
  return input.value;
}

/**
 * The answer form for `schema`, built into `container`. Returns `approval` (a boolean
 * `approved` is answered by Approve and Reject buttons instead of a field) and
 * `read(approved)`, the answer as typed (it throws when a JSON answer does not parse).
 */
export function answerForm(container, schema) {
  container.replaceChildren();
  const approval = hasApproved(schema);
  const read = formable(schema) ? fieldsOf(container, schema, approval) : jsonArea(container, schema);
  return {
    approval,
    read: (approved) => {
      const value = read();
      if (approval) value.approved = approved;
      return value;
    },
  };
}

function fieldsOf(container, schema, approval) {
  const required = new Set(schema.required || []);
  const readers = [];
  for (const [name, property] of Object.entries(schema.properties)) {
    // With a boolean `approved`, the Approve and Reject buttons are its answer.
    if (approval && name === "approved") continue;
    const field = fieldFor(name, property, required.has(name));
    container.append(field.wrap);
    readers.push([name, field.read]);
  }
  return () => {
    const value = {};
    for (const [name, readOne] of readers) {
      const got = readOne();
      if (got !== undefined) value[name] = got;
    }
    return value;
  };
}

function jsonArea(container, schema) {
  const area = el("textarea", { id: "field-json", rows: 6, spellcheck: false, text: "{}" });
  container.append(
    el("div", { class: "field field-json" },
      el("label", { htmlFor: "field-json", text: "Answer (JSON)" }), area,
      el("pre", { class: "hint schema", text: `schema: ${JSON.stringify(schema)}` })),
  );
  return () => JSON.parse(area.value);
}
