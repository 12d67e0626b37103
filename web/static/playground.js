// The playground's one script: the form becomes a streamed POST /v1/completions, and the answer
// becomes coloured tokens on the page. It speaks only the public /v1 API, as any client would.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "nanoserve.apiKey";
const MODEL_STORAGE = "nanoserve.model";
let controller = null; // the running request's AbortController

function authHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

// The message of an error response, from OpenAI's envelope {"error": {"message", "type", ...}}.
async function errorMessage(response) {
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    // not JSON (a proxy's page): the status line says enough
  }
  const message = body && body.error && body.error.message;
  return `Error ${response.status}: ${message || response.statusText}`;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

async function loadModels() {
  clearError();
  const select = $("model");
  const wanted = select.value || localStorage.getItem(MODEL_STORAGE);
  let response;
  try {
    response = await fetch("/v1/models", { headers: authHeaders() });
  } catch (err) {
    return showError(`Cannot reach the server: ${err.message}`);
  }
  if (!response.ok) {
    select.replaceChildren();
    return showError(await errorMessage(response));
  }
  const models = (await response.json()).data;
  select.replaceChildren(...models.map((model) => new Option(model.id, model.id)));
  if (models.some((model) => model.id === wanted)) select.value = wanted;
}

// The request body: empty fields are left out, so the server's defaults apply.
function requestBody() {
  const body = {
    model: $("model").value,
    prompt: $("prompt").value,
    stream: true,
    stream_options: { include_usage: true },
  };
  const fields = { "max-tokens": "max_tokens", temperature: "temperature", "top-p": "top_p",
                   seed: "seed", logprobs: "logprobs" };
  for (const [id, name] of Object.entries(fields)) {
    const value = $(id).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  const stop = $("stop").value.split("\n").filter((line) => line !== "")
    .map((line) => line.replaceAll("\\n", "\n"));
  if (stop.length) body.stop = stop;
  // vLLM's structured_outputs: a JSON schema goes as its text (the server parses it and names a mistake)
  const form = $("structured").value;
  const constraint = $("constraint").value;
  if (form && constraint.trim() !== "") {
    const value = form === "choice" ? constraint.split("\n").filter((line) => line !== "") : constraint;
    body.structured_outputs = { [form]: value };
  }
  return body;
}

// The `data:` payloads of a server-sent event stream, as they arrive. `id:` lines and `: keepalive`
// comments carry nothing the page needs.
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split(/\r\n|\r|\n/);
    buffer = lines.pop(); // an unfinished line waits for the next read
    for (const line of lines) {
      if (line === "" && data.length) {
        yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      }
    }
  }
}

const percent = (logprob) => `${(100 * Math.exp(logprob)).toFixed(1)}%`;

function tokenSpan(text, token) {
  const span = document.createElement("span");
  span.className = "token";
  span.textContent = text;
  // red (improbable) → yellow → green (certain)
  span.style.backgroundColor = `hsl(${Math.round(120 * Math.exp(token.logprob))} 75% 80%)`;
  span.dataset.logprob = token.logprob;
  const alternatives = Object.entries(token.top || {}).sort((a, b) => b[1] - a[1])
    .map(([alternative, logprob]) => `  ${JSON.stringify(alternative)}  ${percent(logprob)}  (${logprob.toFixed(3)})`);
  span.dataset.tip = [`${JSON.stringify(token.token)}  ${percent(token.logprob)}  (logprob ${token.logprob.toFixed(3)})`,
                      ...(alternatives.length ? ["top alternatives:", ...alternatives] : [])].join("\n");
  return span;
}

// The hovered token's tooltip: its probability and the top alternatives, below the token.
function showTip(event) {
  const span = event.target.closest(".token");
  if (!span) return;
  const tip = $("tooltip");
  const box = span.getBoundingClientRect();
  tip.textContent = span.dataset.tip;
  tip.hidden = false;
  const left = Math.min(box.left, document.documentElement.clientWidth - tip.offsetWidth - 8);
  tip.style.left = `${Math.max(left, 0) + window.scrollX}px`;
  tip.style.top = `${box.bottom + window.scrollY + 4}px`;
}

// What one run has received so far, drawn into the page as it arrives.
//
// Logprobs arrive with each token, but the text of a token can arrive later: the server holds back
// text that could start a stop sequence, and a character split over several tokens appears with its
// last one. So the text is kept apart (as code points, the unit of `text_offset`) and a token is
// drawn once the text up to the next token's offset has arrived.
class Completion {
  constructor(element, withLogprobs) {
    this.element = element;
    this.withLogprobs = withLogprobs;
    this.text = []; // code points
    this.tokens = []; // {token, logprob, top, offset}
    this.drawn = 0;
    this.chunks = 0;
    this.finishReason = null;
    this.usage = null;
  }

  add(chunk) {
    this.chunks += 1;
    this.element.dataset.chunks = this.chunks;
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices) {
      this.text.push(...choice.text);
      if (choice.finish_reason) this.finishReason = choice.finish_reason;
      const lp = choice.logprobs;
      if (!this.withLogprobs || !lp) {
        this.element.append(choice.text);
        continue;
      }
      lp.tokens.forEach((token, i) => this.tokens.push({
        token, logprob: lp.token_logprobs[i], top: lp.top_logprobs[i], offset: lp.text_offset[i],
      }));
      this.draw(false);
    }
  }

  // Draw the tokens whose text has arrived; `last`: the text is complete (tokens past its end were
  // cut by a stop sequence).
  draw(last) {
    if (!this.tokens.length) return;
    const base = this.tokens[0].offset; // offsets count from the prompt's start
    while (this.drawn < this.tokens.length) {
      const token = this.tokens[this.drawn];
      const next = this.tokens[this.drawn + 1];
      const end = next ? next.offset - base : this.text.length;
      if (!last && (!next || end > this.text.length)) break;
      const text = this.text.slice(token.offset - base, end).join("");
      if (text) this.element.append(tokenSpan(text, token));
      this.drawn += 1;
    }
  }
}

function setRunning(running, state) {
  $("run").disabled = running;
  $("stop-run").disabled = !running;
  $("output").dataset.state = state;
}

function summary(completion, seconds) {
  const parts = [`finish: ${completion.finishReason || "none"}`];
  const usage = completion.usage;
  if (usage) {
    parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion = ${usage.total_tokens} tokens`);
    parts.push(`${(usage.completion_tokens / seconds).toFixed(1)} tokens/s`); // queueing and prefill included
  }
  parts.push(`${seconds.toFixed(2)} s`);
  return parts.join(" · ");
}

async function run(event) {
  event.preventDefault();
  clearError();
  const body = requestBody();
  const output = $("output");
  const prompt = document.createElement("span");
  prompt.className = "prompt";
  prompt.textContent = body.prompt;
  const generated = document.createElement("span");
  generated.className = "completion";
  output.replaceChildren(prompt, generated);
  const completion = new Completion(generated, body.logprobs !== undefined);
  localStorage.setItem(MODEL_STORAGE, body.model);

  controller = new AbortController();
  setRunning(true, "running");
  $("status").textContent = "running…";
  const started = performance.now();
  let state = "done";
  try {
    const response = await fetch("/v1/completions", {
      method: "POST", headers: authHeaders(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(`Error: ${chunk.error.message}`);
      completion.add(chunk);
    }
    $("status").textContent = summary(completion, (performance.now() - started) / 1000);
  } catch (err) {
    state = err.name === "AbortError" ? "stopped" : "error";
    $("status").textContent = state === "stopped" ? "stopped" : "";
    if (state === "error") showError(err.message);
  } finally {
    completion.draw(true);
    controller = null;
    setRunning(false, state);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("api-key").value = localStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    const key = $("api-key").value.trim();
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
    loadModels();
  });
  $("run-form").addEventListener("submit", run);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && !controller) $("run-form").requestSubmit();
  });
  $("stop-run").addEventListener("click", () => controller && controller.abort());
  $("output").addEventListener("mouseover", showTip);
  $("output").addEventListener("mouseout", () => { $("tooltip").hidden = true; });
  loadModels();
});
