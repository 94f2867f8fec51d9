/**
 * Wires the Probing panel into JupyterLab: the sidebar panel (restored with the
 * layout), its settings, the chosen job kept in the state database, and the commands
 * (palette and panel toolbar). The panel's logic lives in `model.ts`, its views in
 * `panel.tsx`, the server calls in `request.ts`.
 */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStateDB } from '@jupyterlab/statedb';
import { addIcon, refreshIcon } from '@jupyterlab/ui-components';

// the panel is added to the sidebar at activation: its model and views are needed at once
// eslint-disable-next-line jupyter/prefer-lazy-imports
import { ClusterModel } from './model';
// eslint-disable-next-line jupyter/prefer-lazy-imports
import { ClusterPanel, clusterIcon } from './panel';

const PLUGIN_ID = 'probing-magics:plugin';
const STATE_KEY = 'probing-magics:cluster';

export namespace CommandIDs {
  export const insertSqlCell = 'probing-magics:insert-sql-cell';
  export const refresh = 'probing-magics:refresh';
  export const open = 'probing-magics:open';
}

/** The commands take no arguments (`isPalette` is JupyterLab's own). */
const NO_ARGS = { args: { type: 'object' as const, properties: {} } };

/** What the inserted cell starts with: the straggler query of the demo. */
export const SQL_CELL =
  '%%cluster_sql\n' +
  'SELECT _rank, count(*) AS steps, round(avg(duration_ms), 1) AS avg_ms\n' +
  'FROM steps GROUP BY _rank ORDER BY avg_ms DESC';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'The Probing panel: the ranks of a running distributed PyTorch job at a glance.',
  autoStart: true,
  optional: [ILayoutRestorer, ISettingRegistry, ICommandPalette, INotebookTracker, IStateDB],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    settingRegistry: ISettingRegistry | null,
    palette: ICommandPalette | null,
    notebooks: INotebookTracker | null,
    state: IStateDB | null
  ) => {
    const model = new ClusterModel();

    app.commands.addCommand(CommandIDs.insertSqlCell, {
      label: 'Insert a %%cluster_sql Cell',
      describedBy: NO_ARGS,
      caption: 'Insert a %%cluster_sql cell below the active cell of the current notebook',
      icon: args => (args.isPalette ? undefined : addIcon),
      isEnabled: () => !!notebooks?.currentWidget,
      execute: () => {
        const current = notebooks?.currentWidget;
        if (!current) {
          return;
        }
        const notebook = current.content;
        NotebookActions.insertBelow(notebook);
        notebook.activeCell?.model.sharedModel.setSource(SQL_CELL);
        app.shell.activateById(current.id);
      }
    });
    notebooks?.currentChanged.connect(() => app.commands.notifyCommandChanged(CommandIDs.insertSqlCell));

    app.commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh the Probing Panel',
      describedBy: NO_ARGS,
      icon: args => (args.isPalette ? undefined : refreshIcon),
      execute: () => model.refresh()
    });

    const panel = new ClusterPanel(model, app.commands, [CommandIDs.insertSqlCell, CommandIDs.refresh]);
    app.commands.addCommand(CommandIDs.open, {
      label: 'Show the Probing Panel',
      describedBy: NO_ARGS,
      icon: args => (args.isPalette ? undefined : clusterIcon),
      execute: () => app.shell.activateById(panel.id)
    });
    for (const command of Object.values(CommandIDs)) {
      palette?.addItem({ command, category: 'Probing' });
    }

    app.shell.add(panel, 'left', { rank: 850 });
    restorer?.add(panel, 'probing-cluster');

    if (settingRegistry) {
      void settingRegistry.load(PLUGIN_ID).then(
        settings => {
          const apply = () => {
            model.intervalSeconds = settings.get('pollInterval').composite as number;
          };
          apply();
          settings.changed.connect(apply);
        },
        reason => console.warn('probing-magics: settings not loaded', reason)
      );
    }

    // start once the layout is back, with the job chosen last time (kept even while it is not running)
    void app.restored.then(async () => {
      let chosen: string | null = null;
      if (state) {
        const saved = (await state.fetch(STATE_KEY).catch(() => null)) as { job?: string } | null;
        chosen = saved?.job ?? null;
        model.chosenChanged.connect((_, job) => void state.save(STATE_KEY, { job }));
      }
      model.start(chosen);
    });
  }
};

export default plugin;
