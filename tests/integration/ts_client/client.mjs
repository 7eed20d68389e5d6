// The official TypeScript SDK client (@modelcontextprotocol/sdk) as a Node host drives
// toolsetd: the steps named on the command line run in order on one connection, and one
// JSON report (a record per step) is printed on stdout. test_mcp_ts_client.py installs the
// SDK, writes the configuration and asserts on the report.
//
// Usage: node client.mjs CONFIG.json STEP...
// CONFIG: {"sdk": folder holding node_modules/@modelcontextprotocol/sdk,
//          "transport": "stdio" | "http", "command": [argv...] (stdio), "url": ... (http),
//          "workspace": folder, "write": {path: text} and "expect": a tool name (the
//          list_changed step's edit and the tool it adds), "calls": [{name, arguments}],
//          "package": "client" for the 2.x client (sdk: the folder holding it),
//          "negotiation": its versionNegotiation mode}
import { readFileSync, existsSync, writeFileSync, mkdirSync, chmodSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { pathToFileURL } from 'node:url';

const [configPath, ...steps] = process.argv.slice(2);
const config = JSON.parse(readFileSync(configPath, 'utf8'));
// The 1.x SDK (@modelcontextprotocol/sdk) takes handlers by zod schema; the 2.x client
// (@modelcontextprotocol/client, "package": "client") by method name.
const v2 = config.package === 'client';
const esm = v2
  ? join(config.sdk, 'node_modules', '@modelcontextprotocol', 'client', 'dist')
  : join(config.sdk, 'node_modules', '@modelcontextprotocol', 'sdk', 'dist', 'esm');
const load = (path) => import(pathToFileURL(join(esm, path)).href);
const { Client } = await load(v2 ? 'index.mjs' : 'client/index.js');
const { StdioClientTransport } = await load(v2 ? 'stdio.mjs' : 'client/stdio.js');
const { StreamableHTTPClientTransport } = await load(v2 ? 'index.mjs' : 'client/streamableHttp.js');
const { ElicitRequestSchema, ToolListChangedNotificationSchema } = v2
  ? { ElicitRequestSchema: 'elicitation/create', ToolListChangedNotificationSchema: 'notifications/tools/list_changed' }
  : await load('types.js');

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
// A call with request options (onprogress, signal): the 1.x client takes them after a
// result schema, callTool(params, resultSchema, options); the 2.x client has no schema
// argument, callTool(params, options), and ignored them in the third place.
const callTool = (client, params, options) => (v2
  ? client.callTool(params, options)
  : client.callTool(params, undefined, options));
const text = (result) => (result.content ?? []).filter((b) => b.type === 'text').map((b) => b.text).join('');
const failure = (error) => ({ name: error?.constructor?.name, code: error?.code, message: String(error?.message ?? error) });

/** A connected client; ``answer`` is what its elicitation handler says (changeable). */
async function connect(state, sessionId, errors = state.errors) {
  // "negotiation": "auto" has the 2.x client probe for 2026-07-28 (its default is 2025-11-25).
  const negotiation = config.negotiation ? { versionNegotiation: { mode: config.negotiation } } : {};
  const client = new Client({ name: 'toolsetd-ts-test', version: '1' }, { capabilities: { elicitation: {} }, ...negotiation });
  // What the client's own close() aborts (its open SSE streams) is no error of the server's.
  let closing = false;
  client.onerror = (error) => closing || errors.push({ phase: state.phase, ...failure(error) });
  const close = client.close.bind(client);
  client.close = () => { closing = true; return close(); };
  client.setRequestHandler(ElicitRequestSchema, async (request, extra) => {
    state.asked.push({ mode: request.params.mode ?? null, message: request.params.message });
    if (state.answer === 'wait') {
      // A person who has not answered yet: the question stays up until it is withdrawn.
      state.waiting?.();
      await new Promise((resolve) => extra.signal.addEventListener('abort', resolve));
      state.withdrawn.push(String(extra.signal.reason ?? 'aborted'));
      return { action: 'cancel' };
    }
    if (state.answer === 'throw') throw new Error('this host cannot show the question');
    return state.answer === 'accept' ? { action: 'accept', content: {} } : { action: state.answer };
  });
  client.setNotificationHandler(ToolListChangedNotificationSchema, async () => {
    state.listChanged += 1;
  });
  // No env for stdio: the pump gets what the SDK passes a host's server by default.
  const transport = config.transport === 'stdio'
    ? new StdioClientTransport({ command: config.command[0], args: config.command.slice(1), stderr: 'pipe' })
    : new StreamableHTTPClientTransport(new URL(config.url), sessionId ? { sessionId } : {});
  if (config.transport === 'stdio') {
    transport.stderr?.on('data', (chunk) => { state.stderr += chunk.toString(); });
  }
  await client.connect(transport);
  // The SDK handles a response as it is read, but a notification a microtask later: a
  // call's progress read in one chunk with its response (a host too busy to read them one
  // by one) found its token retired, and was reported as an unknown token's
  // (typescript-sdk#2580). Each response waits one microtask here, behind the
  // notifications read before it: what is still reported is progress that came after its
  // response on the wire.
  const dispatch = transport.onmessage;
  transport.onmessage = (message, extra) => {
    if ('id' in message && !('method' in message)) queueMicrotask(() => dispatch(message, extra));
    else dispatch(message, extra);
  };
  return { client, transport };
}

async function allTools(client) {
  const names = [];
  let pages = 0;
  let cursor;
  do {
    const page = await client.listTools(cursor ? { cursor } : {});
    pages += 1;
    names.push(...page.tools.map((t) => t.name));
    cursor = page.nextCursor;
  } while (cursor);
  return { names, pages };
}

const stepsByName = {
  async initialize(ctx) {
    return {
      era: ctx.client.getProtocolEra?.() ?? null,
      server: ctx.client.getServerVersion(),
      capabilities: ctx.client.getServerCapabilities(),
      sessionId: ctx.transport.sessionId ?? null,
      protocolVersion: ctx.transport.protocolVersion ?? null,
    };
  },
  async list(ctx) {
    const { names, pages } = await allTools(ctx.client);
    const first = await ctx.client.listTools();
    const hello = first.tools.find((t) => t.name === 'hello') ?? null;
    const tools = Object.fromEntries(first.tools.filter((t) => !t.name.startsWith('paged_')).map((t) => [t.name, t]));
    return { count: names.length, unique: new Set(names).size, pages, hello, names: names.filter((n) => !n.startsWith('paged_')), tools };
  },
  async call(ctx) {
    const hello = await ctx.client.callTool({ name: 'hello', arguments: { name: 'Ada' } });
    const fails = await ctx.client.callTool({ name: 'fails', arguments: {} });
    const progress = [];
    const counted = await callTool(ctx.client, { name: 'progress3', arguments: {} }, {
      onprogress: (p) => progress.push(p),
    });
    let unknown = null;
    try {
      await ctx.client.callTool({ name: 'no_such_tool', arguments: {} });
    } catch (error) {
      unknown = failure(error);
    }
    return {
      hello: { isError: hello.isError ?? false, text: text(hello) },
      fails: { isError: fails.isError ?? false, text: text(fails) },
      progress3: { isError: counted.isError ?? false, text: text(counted), progress },
      unknown,
    };
  },
  async parallel(ctx) {
    // Hosts run a model's tool calls side by side: each keeps its own progress.
    const runs = Array.from({ length: 6 }, async () => {
      const progress = [];
      const result = await callTool(ctx.client, { name: 'progress3', arguments: {} }, {
        onprogress: (p) => progress.push(p.message ?? null),
      });
      return { isError: result.isError ?? false, text: text(result), progress: progress.filter((m) => m) };
    });
    const pong = await ctx.client.ping();
    return { results: await Promise.all(runs), pong };
  },
  async calls(ctx) {
    const out = [];
    for (const { name, arguments: args } of config.calls) {
      const result = await ctx.client.callTool({ name, arguments: args });
      out.push({ isError: result.isError ?? false, text: text(result) });
    }
    return { results: out };
  },
  async cancel(ctx) {
    const pidFile = join(config.workspace, 'sleeper.pid');
    const controller = new AbortController();
    const call = callTool(ctx.client, { name: 'sleeper', arguments: {} }, { signal: controller.signal });
    const outcome = call.then(() => null, (error) => failure(error));
    while (!existsSync(pidFile) || !readFileSync(pidFile, 'utf8')) await sleep(20);
    controller.abort('the host gave up');
    const error = await outcome;
    const after = await ctx.client.callTool({ name: 'hello', arguments: { name: 'B' } });
    return { error, pid: Number(readFileSync(pidFile, 'utf8')), after: text(after) };
  },
  async withdrawn(ctx) {
    // The host gives up on a call whose approval is still being asked.
    ctx.state.answer = 'wait';
    ctx.state.withdrawn = [];
    const asked = new Promise((resolve) => { ctx.state.waiting = resolve; });
    const controller = new AbortController();
    const call = callTool(ctx.client, { name: config.asker ?? 'asker', arguments: {} }, { signal: controller.signal })
      .then(() => null, (error) => failure(error));
    await asked;
    controller.abort('the host gave up');
    const error = await call;
    while (ctx.state.withdrawn.length === 0) await sleep(20);
    return { error, withdrawn: ctx.state.withdrawn };
  },
  async approvals(ctx) {
    const out = {};
    for (const answer of config.answers ?? ['accept', 'decline']) {
      ctx.state.answer = answer;
      const result = await ctx.client.callTool({ name: config.asker ?? 'asker', arguments: {} });
      out[answer] = { isError: result.isError ?? false, text: text(result) };
    }
    out.asked = ctx.state.asked;
    return out;
  },
  async list_changed(ctx) {
    const before = (await allTools(ctx.client)).names;
    for (const [path, body] of Object.entries(config.write)) {
      mkdirSync(dirname(path), { recursive: true });
      writeFileSync(path, body);
      if (!path.endsWith('.json')) chmodSync(path, 0o755);
    }
    // The watcher may announce tools.json seen half-written first: wait, list, again.
    const wanted = config.expect;
    let seen = 0;
    for (;;) {
      while (ctx.state.listChanged === seen) await sleep(20);
      seen = ctx.state.listChanged;
      if ((await allTools(ctx.client)).names.includes(wanted)) break;
    }
    return { before: before.includes(wanted), notifications: seen };
  },
  async terminate(ctx) {
    const old = ctx.transport.sessionId;
    await ctx.transport.terminateSession();
    const cleared = ctx.transport.sessionId ?? null;
    ctx.state.phase = 'terminate:close';
    await ctx.client.close();
    ctx.state.phase = 'terminate:stale';
    // A host that kept the old id (a restart) is told the session is gone, then starts over.
    let stale = null;
    const staleErrors = [];
    try {
      const again = await connect(ctx.state, old, staleErrors);
      await again.client.listTools();
      await again.client.close();
    } catch (error) {
      stale = failure(error);
    }
    ctx.state.phase = 'terminate:fresh';
    const fresh = await connect(ctx.state);
    ctx.client = fresh.client;
    ctx.transport = fresh.transport;
    const listed = await allTools(ctx.client);
    const hello = await ctx.client.callTool({ name: 'hello', arguments: { name: 'C' } });
    return {
      old, cleared, stale, staleErrors, renewed: ctx.transport.sessionId ?? null,
      count: listed.names.length, hello: text(hello),
    };
  },
};

const state = { answer: 'accept', asked: [], listChanged: 0, errors: [], stderr: '' };
const report = { steps: {} };
let ctx;
try {
  ctx = { state, ...(await connect(state)) };
  for (const step of steps) {
    state.phase = step;
    try {
      report.steps[step] = { ok: true, ...(await stepsByName[step](ctx)) };
    } catch (error) {
      report.steps[step] = { ok: false, error: failure(error) };
    }
  }
} catch (error) {
  report.connect = failure(error);
}
state.phase = 'close';
try {
  await ctx?.client.close();
} catch (error) {
  report.close = failure(error);
}
report.errors = state.errors;
report.stderr = state.stderr;
process.stdout.write(JSON.stringify(report) + '\n', () => process.exit(0));
