// The codebroker playground: plain JavaScript against the broker's own API on the same
// origin (/health, /exec/stream, /upload, /files, /download). Paths are relative, so the
// page works at / and under /v1/ alike. The key and the session live in localStorage.
'use strict';

const KEY_STORE = 'codebroker.apiKey';
const SESSION_STORE = 'codebroker.session';
const LANG_STORE = 'codebroker.lang';

// The sample program per language, from the broker's language table (samples.json);
// Python opens on a plot instead, the one thing a hello world cannot show.
const SAMPLES = {};
const PYTHON_SAMPLE = [
  'import numpy as np',
  'import matplotlib.pyplot as plt',
  '',
  'x = np.linspace(0, 2 * np.pi, 200)',
  'print("hello from the playground:", round(float(np.sin(x).max()), 3))',
  'plt.plot(x, np.sin(x), label="sin")',
  'plt.plot(x, np.cos(x), label="cos")',
  'plt.legend()',
  'plt.title("codebroker")',
  'plt.show()',
].join('\n');

const $ = (id) => document.getElementById(id);
const ui = {
  key: $('api-key'),
  keyForm: $('key-form'),
  keyState: $('key-state'),
  lang: $('lang'),
  code: $('code'),
  run: $('run'),
  stop: $('stop'),
  session: $('session'),
  newSession: $('new-session'),
  status: $('status'),
  output: $('output'),
  upload: $('upload'),
  refresh: $('refresh-files'),
  files: $('files'),
};

// Edited code per language, so switching languages does not lose work.
const drafts = {};
let running = null; // AbortController of the exec under way
let objectUrls = []; // revoked when the file list is redrawn

function apiKey() {
  return localStorage.getItem(KEY_STORE) || '';
}

function session() {
  return localStorage.getItem(SESSION_STORE) || '';
}

function setSession(id) {
  if (id) localStorage.setItem(SESSION_STORE, id);
  else localStorage.removeItem(SESSION_STORE);
  ui.session.textContent = id || 'none yet';
}

function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h['X-API-Key'] = key;
  return h;
}

function setStatus(text, isError = false) {
  ui.status.textContent = text;
  ui.status.classList.toggle('error', isError);
}

// The error envelope ({error, message}) as one line; a 401 points at the key field.
async function describeError(res) {
  let message = `${res.status} ${res.statusText}`;
  try {
    const body = await res.json();
    if (body && body.message) message = `${res.status}: ${body.message}`;
  } catch {
    /* not JSON */
  }
  if (res.status === 401) {
    message += ' (enter the API key above)';
    ui.keyState.textContent = 'key needed';
    ui.keyState.classList.add('error');
  }
  return message;
}

function append(kind, text) {
  const last = ui.output.lastElementChild;
  if (last && last.tagName === 'PRE' && last.classList.contains(kind)) {
    last.textContent += text;
  } else {
    const pre = document.createElement('pre');
    pre.className = kind;
    pre.textContent = text;
    ui.output.appendChild(pre);
  }
  ui.output.scrollTop = ui.output.scrollHeight;
}

function showDisplay(display) {
  if (display && display.data && /^image\//.test(display.mime || '')) {
    const img = document.createElement('img');
    img.alt = display.name || 'figure';
    img.className = 'display';
    img.src = `data:${display.mime};base64,${display.data}`;
    ui.output.appendChild(img);
  } else if (display && display.name) {
    append('stdout', `[${display.mime}: ${display.name}]\n`);
  }
}

// Server-sent events from a fetch body: yields {event, data} with data lines joined. A block
// of comments only (the broker's `: keep-alive` while code is silent) is no event.
async function* sseEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, '\n');
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = null;
      const data = [];
      for (const line of block.split('\n')) {
        if (line.startsWith('event:')) event = line.slice(6).trim();
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
      }
      if (event === null && data.length === 0) continue;
      yield { event: event ?? 'message', data: data.join('\n') };
    }
  }
}

async function run() {
  if (running) return;
  const lang = ui.lang.value;
  const body = { lang, code: ui.code.value };
  if (session()) body.session_id = session();
  ui.output.replaceChildren();
  setStatus('running…');
  running = new AbortController();
  ui.run.disabled = true;
  ui.stop.disabled = false;
  const started = performance.now();
  try {
    const res = await fetch('exec/stream', {
      method: 'POST',
      headers: headers({ 'Content-Type': 'application/json', Accept: 'text/event-stream' }),
      body: JSON.stringify(body),
      signal: running.signal,
    });
    if (!res.ok) {
      setStatus(await describeError(res), true);
      return;
    }
    let result = null;
    for await (const { event, data } of sseEvents(res.body)) {
      if (event === 'stdout' || event === 'stderr') append(event, data);
      else if (event === 'display') showDisplay(JSON.parse(data));
      else if (event === 'result') result = JSON.parse(data);
      else if (event === 'error') {
        const err = JSON.parse(data);
        setStatus(`error: ${err.message || data}`, true);
        return;
      }
    }
    if (!result) {
      setStatus('the stream ended without a result', true);
      return;
    }
    setSession(result.session_id);
    const took = Math.round(performance.now() - started);
    const parts = [`exit ${result.exit_code ?? '–'}`, `${result.duration_ms} ms in the broker`, `${took} ms here`];
    if (result.runtime_status) parts.push(`kernel ${result.runtime_status}`);
    if (result.limits && result.limits.length) parts.push(`limits: ${result.limits.join(', ')}`);
    setStatus(parts.join(' · '), result.exit_code !== 0);
    ui.output.dataset.done = 'true';
    await listFiles();
  } catch (err) {
    if (err.name === 'AbortError') setStatus('stopped');
    else setStatus(`cannot reach the broker: ${err.message}`, true);
  } finally {
    running = null;
    ui.run.disabled = false;
    ui.stop.disabled = true;
  }
}

async function fetchBlob(file) {
  const res = await fetch(`download/${encodeURIComponent(file.storage_session_id)}/${encodeURIComponent(file.id)}`, {
    headers: headers(),
  });
  if (!res.ok) throw new Error(await describeError(res));
  const url = URL.createObjectURL(await res.blob());
  objectUrls.push(url);
  return url;
}

async function download(file) {
  try {
    const url = await fetchBlob(file);
    const a = document.createElement('a');
    a.href = url;
    a.download = file.name.split('/').pop();
    document.body.appendChild(a);
    a.click();
    a.remove();
  } catch (err) {
    setStatus(`download failed: ${err.message}`, true);
  }
}

function formatSize(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

async function listFiles() {
  const id = session();
  for (const url of objectUrls) URL.revokeObjectURL(url);
  objectUrls = [];
  if (!id) {
    ui.files.replaceChildren();
    return;
  }
  const res = await fetch(`files/${encodeURIComponent(id)}?detail=normalized`, { headers: headers() });
  if (!res.ok) {
    setStatus(`cannot list files: ${await describeError(res)}`, true);
    return;
  }
  const files = await res.json();
  const items = [];
  for (const file of files) {
    const li = document.createElement('li');
    li.dataset.name = file.name;
    const row = document.createElement('div');
    row.className = 'row';
    const name = document.createElement('span');
    name.className = 'name';
    name.textContent = file.name;
    const size = document.createElement('span');
    size.className = 'size';
    size.textContent = formatSize(file.size || 0);
    const button = document.createElement('button');
    button.textContent = 'Download';
    button.addEventListener('click', () => download(file));
    row.append(name, size, button);
    li.appendChild(row);
    if (/^image\/(png|jpeg|gif|webp|svg\+xml)$/.test(file.contentType || '')) {
      const img = document.createElement('img');
      img.alt = file.name;
      fetchBlob(file)
        .then((url) => (img.src = url))
        .catch(() => img.remove());
      li.appendChild(img);
    }
    items.push(li);
  }
  ui.files.replaceChildren(...items);
}

async function upload() {
  const chosen = [...ui.upload.files];
  if (chosen.length === 0) return;
  const form = new FormData();
  if (session()) form.append('session_id', session());
  for (const file of chosen) form.append('file', file, file.name);
  setStatus(`uploading ${chosen.length} file(s)…`);
  try {
    const res = await fetch(chosen.length === 1 ? 'upload' : 'upload/batch', {
      method: 'POST',
      headers: headers(),
      body: form,
    });
    if (!res.ok) {
      setStatus(`upload failed: ${await describeError(res)}`, true);
      return;
    }
    const answer = await res.json();
    setSession(answer.session_id);
    setStatus(`uploaded ${chosen.map((f) => f.name).join(', ')} to /mnt/data`);
    ui.upload.value = '';
    await listFiles();
  } catch (err) {
    setStatus(`upload failed: ${err.message}`, true);
  }
}

async function loadSamples() {
  try {
    const res = await fetch('playground/samples.json');
    for (const { lang, code } of await res.json()) SAMPLES[lang] = code;
  } catch (err) {
    setStatus(`cannot load the samples: ${err.message}`, true);
  }
  if ('py' in SAMPLES) SAMPLES.py = PYTHON_SAMPLE;
}

async function loadLanguages() {
  await loadSamples();
  let languages = Object.keys(SAMPLES);
  try {
    const res = await fetch('health');
    const health = await res.json();
    if (Array.isArray(health.languages) && health.languages.length) languages = health.languages;
    if (health.status !== 'ok') setStatus(`the broker reports: ${health.status}`, true);
  } catch (err) {
    setStatus(`cannot reach the broker: ${err.message}`, true);
  }
  ui.lang.replaceChildren(
    ...languages.map((l) => {
      const option = document.createElement('option');
      option.value = l;
      option.textContent = l;
      return option;
    }),
  );
  const saved = localStorage.getItem(LANG_STORE);
  ui.lang.value = languages.includes(saved) ? saved : languages.includes('py') ? 'py' : languages[0];
  ui.code.value = SAMPLES[ui.lang.value] || '';
  ui.lang.dataset.current = ui.lang.value;
}

function wire() {
  ui.key.value = apiKey();
  ui.keyState.textContent = apiKey() ? 'saved' : '';
  ui.keyForm.addEventListener('submit', (e) => {
    e.preventDefault();
    const key = ui.key.value.trim();
    if (key) localStorage.setItem(KEY_STORE, key);
    else localStorage.removeItem(KEY_STORE);
    ui.keyState.textContent = key ? 'saved' : 'cleared';
    ui.keyState.classList.remove('error');
    listFiles();
  });
  ui.lang.addEventListener('change', () => {
    drafts[ui.lang.dataset.current] = ui.code.value;
    ui.lang.dataset.current = ui.lang.value;
    localStorage.setItem(LANG_STORE, ui.lang.value);
    ui.code.value = drafts[ui.lang.value] ?? SAMPLES[ui.lang.value] ?? '';
  });
  ui.run.addEventListener('click', run);
  ui.stop.addEventListener('click', () => running && running.abort());
  ui.code.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      run();
    } else if (e.key === 'Tab' && !e.shiftKey) {
      e.preventDefault();
      const { selectionStart: s, selectionEnd: t, value } = ui.code;
      ui.code.value = value.slice(0, s) + '    ' + value.slice(t);
      ui.code.selectionStart = ui.code.selectionEnd = s + 4;
    }
  });
  ui.newSession.addEventListener('click', () => {
    setSession('');
    ui.output.replaceChildren();
    ui.files.replaceChildren();
    setStatus('the next run starts a new session');
  });
  ui.upload.addEventListener('change', upload);
  ui.refresh.addEventListener('click', listFiles);
  setSession(session());
}

wire();
loadLanguages().then(listFiles);
